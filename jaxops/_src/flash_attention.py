"""Float32 flash attention for a GPU, written in Pallas (Triton): softmax(scale Q K^T) V without
a [T, S] matrix in memory, forward and backward.

Operands are [batch, seq, heads, head] (the layout a QKV projection's output already has, so
the graph's transposes around attention cancel), or one packed [batch, seq, 3, heads, head]
array (a fused QKV projection's output as it is: no copies of its three slices, and its gradient
comes out packed, with no concatenation after). cuDNN's flash attention takes f16/bf16 only;
these kernels keep float32 operands, their products at the matmul precision in force (TF32 by
default on a GPU, IEEE under "float32").

The backward follows FlashAttention-2: one program per key block loops over the query blocks,
keeps dK and dV in registers and adds each query block's share of dQ into a float32 buffer
with atomics, so every product of the backward is computed once (five matmuls a block pair).
Scores are kept in base 2 (exp2 of log2(e)-scaled scores), the log-sum-exp likewise.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    _dot = getattr(plgpu, "dot", None) or pl.dot  # jax < 0.9 keeps it in pallas itself
except ImportError:  # a jax without Pallas' Triton backend: callers run the formula instead
    pl = plgpu = None

_LOG2E = math.log2(math.e)


class Blocks:
    """Tile sizes and Triton settings (measured on an H100: docs/performance.md). The
    backward's 128 x 128 tiles need Hopper's shared memory; other GPUs take 64 x 64 (the
    first tiles tried: 0.79 against 0.64 ms on the H100)."""
    fwd_q, fwd_k, fwd_warps, fwd_stages = 128, 64, 4, 3
    bwd_q, bwd_k, bwd_warps, bwd_stages = 128, 128, 8, 1
    small_bwd = 64, 64, 4, 2

    @classmethod
    def bwd(cls):
        major = str(getattr(jax.devices()[0], "compute_capability", "9")).split(".")[0]
        big = (cls.bwd_q, cls.bwd_k, cls.bwd_warps, cls.bwd_stages)
        return big if major.isdigit() and int(major) >= 9 else cls.small_bwd


def _fits(shape, dtype) -> bool:
    t, h = shape[1], shape[-1]
    return (plgpu is not None and jax.default_backend() == "gpu" and dtype == jnp.float32
            and t % 64 == 0 and h in (16, 32, 64, 128))


def applies(q, k, v) -> bool:
    """Whether the kernels take these [B, T, N, H] operands: float32 on a GPU, one shape for
    all three, T a multiple of 64, a power-of-2 head size from 16 to 128."""
    return (q.ndim == 4 and q.shape == k.shape == v.shape
            and q.dtype == k.dtype == v.dtype and _fits(q.shape, q.dtype))


def applies_packed(qkv) -> bool:
    """applies() for one packed [B, T, 3, N, H] operand."""
    return qkv.ndim == 5 and qkv.shape[2] == 3 and _fits(qkv.shape, qkv.dtype)


def _read(ref, rows, slot):
    """Rows of a [T, H] block, or of slot `slot` of a packed [T, 3, H] block."""
    return ref[rows, :] if slot is None else ref[rows, slot, :]


def _write(ref, rows, slot, value):
    if slot is None:
        ref[rows, :] = value
    else:
        ref[rows, slot, :] = value


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_q, block_k, slots):
    sq, sk, sv = slots
    q = _read(q_ref, pl.ds(pl.multiple_of(pl.program_id(0) * block_q, block_q), block_q), sq)
    head = q.shape[1]
    c = scale * _LOG2E

    def body(j, carry):
        acc, m, l = carry
        rows = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        s = _dot(q, _read(k_ref, rows, sk), trans_b=True) * c
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - m_new[:, None])
        shrink = jnp.exp2(m - m_new)
        acc = acc * shrink[:, None] + _dot(p, _read(v_ref, rows, sv))
        return acc, m_new, l * shrink + p.sum(axis=1)

    init = (jnp.zeros((block_q, head), jnp.float32),
            jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    acc, m, l = lax.fori_loop(0, k_ref.shape[0] // block_k, body, init)
    o_ref[...] = acc / l[:, None]
    lse_ref[...] = m + jnp.log2(l)


def _bwd_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, *,
                scale, block_q, block_k, slots):
    sq, sk, sv = slots
    j = pl.program_id(0)
    rows_k = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k, v = _read(k_ref, rows_k, sk), _read(v_ref, rows_k, sv)
    head = k.shape[1]
    c = scale * _LOG2E
    n_q = do_ref.shape[0] // block_q
    zero = jnp.int32(0)
    dq_at = (lambda rows: (rows, pl.ds(zero, head))) if sq is None else (
        lambda rows: (rows, jnp.int32(sq), pl.ds(zero, head)))

    def body(i, carry):
        dk, dv = carry
        # each key block starts at its own query block: the dQ atomics of concurrent programs
        # land on different rows (3-12% faster than all starting at 0)
        i = lax.rem(i.astype(jnp.int32) + j, jnp.int32(n_q))
        rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q, do = _read(q_ref, rows, sq), do_ref[rows, :]
        # the transposed scores [block_k, block_q]: dK and dV then need no transpose
        p_t = jnp.exp2(_dot(k, q, trans_b=True) * c - lse_ref[rows][None, :])
        dv = dv + _dot(p_t, do)
        ds_t = p_t * (_dot(v, do, trans_b=True) - delta_ref[rows][None, :])
        dk = dk + _dot(ds_t, q)
        plgpu.atomic_add(dq_ref, dq_at(rows), _dot(ds_t, k, trans_a=True) * scale)
        return dk, dv

    zeros = jnp.zeros((block_k, head), jnp.float32)
    dk, dv = lax.fori_loop(0, n_q, body, (zeros, zeros))
    _write(dk_ref, rows_k, sk, dk * scale)
    _write(dv_ref, rows_k, sv, dv)


def _prep_kernel(o_ref, do_ref, delta_ref, dq_ref):
    """Each query row's sum(O * dO), and zeros where the backward adds dQ up."""
    delta_ref[...] = jnp.sum(o_ref[...] * do_ref[...], axis=1)
    dq_ref[...] = jnp.zeros(dq_ref.shape, dq_ref.dtype)


def _tile(size, t):
    """The tile size where it divides T, else 64 (applies() asks T to be a multiple of 64)."""
    return size if t % size == 0 else 64


def _seq_spec(t, h, packed=False):
    """One (batch, head)'s whole [T, H] slice ([T, 3, H] of a packed operand)."""
    if packed:
        return pl.BlockSpec((None, t, 3, None, h), lambda *g: (g[-2], 0, 0, g[-1], 0))
    return pl.BlockSpec((None, t, None, h), lambda *g: (g[-2], 0, g[-1], 0))


def _slots(packed):
    return (0, 1, 2) if packed else (None, None, None)


def _forward(operands, packed, scale, interpret):
    x = operands[0]
    b, t, n, h = x.shape[0], x.shape[1], x.shape[-2], x.shape[-1]
    bq = _tile(Blocks.fwd_q, t)
    kernel = functools.partial(_fwd_kernel, scale=scale, block_q=bq,
                               block_k=_tile(Blocks.fwd_k, t), slots=_slots(packed))
    return pl.pallas_call(
        lambda *refs: kernel(*(refs[:1] * 3 if packed else refs[:3]), *refs[-2:]),
        grid=(t // bq, b, n),
        in_specs=[_seq_spec(t, h, packed)] * len(operands),
        out_specs=[pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, bi, ni: (bi, ni, i))],
        out_shape=[jax.ShapeDtypeStruct((b, t, n, h), jnp.float32),
                   jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=Blocks.fwd_warps,
                                             num_stages=Blocks.fwd_stages),
        interpret=interpret, name="jaxops_flash_fwd_f32",
    )(*operands)


def _prepare(o, do, packed, interpret):
    """(delta, the dQ buffer: zeros in dQ's place, the rest of a packed one left unwritten, for
    the backward writes it whole), one pass over O and dO."""
    b, t, n, h = do.shape
    bq = _tile(Blocks.fwd_q, t)
    rows = pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0))
    dq_rows = pl.BlockSpec((None, bq, None, None, h), lambda i, bi, ni: (bi, i, 0, ni, 0))
    return pl.pallas_call(
        _prep_kernel, grid=(t // bq, b, n), in_specs=[rows, rows],
        out_specs=[pl.BlockSpec((None, None, bq), lambda i, bi, ni: (bi, ni, i)),
                   dq_rows if packed else rows],
        out_shape=[jax.ShapeDtypeStruct((b, n, t), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, 3, n, h) if packed else do.shape, jnp.float32)],
        interpret=interpret, name="jaxops_flash_bwd_prep_f32",
    )(o, do)


def _backward(operands, packed, o, lse, do, scale, interpret):
    b, t, n, h = do.shape
    block_q, block_k, warps, stages = Blocks.bwd()
    bk = _tile(block_k, t)
    delta, dq = _prepare(o, do, packed, interpret)
    lse_spec = pl.BlockSpec((None, None, t), lambda j, bi, ni: (bi, ni, 0))
    kernel = functools.partial(_bwd_kernel, scale=scale, block_q=_tile(block_q, t),
                               block_k=bk, slots=_slots(packed))
    k_in = len(operands)

    def body(*refs):
        ins, outs = refs[:k_in + 4], refs[k_in + 4:]  # ins end with the dQ buffer
        kernel(*(ins[:1] * 3 if packed else ins[:3]), *ins[k_in:k_in + 3],
               *(outs * 3 if packed else outs))

    grads = pl.pallas_call(
        body, grid=(t // bk, b, n),
        in_specs=[_seq_spec(t, h, packed)] * k_in + [_seq_spec(t, h), lse_spec, lse_spec,
                                                     _seq_spec(t, h, packed)],
        out_specs=[_seq_spec(t, h, packed)] * k_in,
        out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in operands],
        input_output_aliases={k_in + 3: 0},  # dQ accumulates into the prepared zeros
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name="jaxops_flash_bwd_f32",
    )(*operands, do, lse, delta, dq)
    return tuple(grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _attention(operands, packed, scale, interpret):
    return _forward(operands, packed, scale, interpret)[0]


def _fwd_rule(operands, packed, scale, interpret):
    o, lse = _forward(operands, packed, scale, interpret)
    return o, (operands, o, lse)


def _bwd_rule(packed, scale, interpret, res, do):
    operands, o, lse = res
    return (_backward(operands, packed, o, lse, do, scale, interpret),)


_attention.defvjp(_fwd_rule, _bwd_rule)


def flash_attention(q, k, v, scale: float, interpret: bool = False):
    """softmax(scale * Q K^T) V for float32 [B, T, N, H] operands (see applies()) -> [B, T, N,
    H]; interpret runs the kernels in Pallas' interpreter (any backend: for tests)."""
    return _attention((q, k, v), False, scale, interpret)


def flash_attention_packed(qkv, scale: float, interpret: bool = False):
    """flash_attention(Q, K, V) of one [B, T, 3, N, H] operand (Q, K, V along axis 2); its
    gradient is one [B, T, 3, N, H] array."""
    return _attention((qkv,), True, scale, interpret)
