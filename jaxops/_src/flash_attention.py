"""Float32 flash attention for a GPU, written in Pallas (Triton): softmax(scale Q K^T) V without
a [T, S] matrix in memory, forward and backward.

Operands are [batch, seq, heads, head] (the layout a QKV projection's output already has, so
the graph's transposes around attention cancel), or one packed [batch, seq, 3, heads, head]
array (a fused QKV projection's output as it is: no copies of its three slices, and its gradient
comes out packed, with no concatenation after). cuDNN's flash attention takes f16/bf16 only;
these kernels keep float32 operands, their products at the matmul precision in force (TF32 by
default on a GPU, IEEE under "float32").

The backward follows FlashAttention-2 in two passes: one program per key block loops over the
query blocks and keeps dK and dV in registers; then one program per query block loops over the
key blocks for dQ, recomputing the scores and dS (two more matmuls a block pair than adding dQ
up with atomics, yet 2-6% faster on an H100, and the same bits every run).
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
    """Tile sizes and Triton settings (measured on an H100: docs/performance.md; the two
    backward passes swept apart with `python -m bench.attention --sweep dkdv|dq --packed`).
    The backward's Hopper tiles need its shared memory; other GPUs take 64 x 64 (the first
    tiles tried: 0.79 against 0.64 ms on the H100)."""
    fwd_q, fwd_k, fwd_warps, fwd_stages = 128, 64, 4, 3
    bwd_q, bwd_k, bwd_warps, bwd_stages = 64, 128, 4, 2  # the dK/dV pass
    dq_q, dq_k, dq_warps, dq_stages = 128, 32, 4, 3      # the dQ pass
    small_bwd = 64, 64, 4, 2

    @classmethod
    def bwd(cls, part="dkdv"):
        major = str(getattr(jax.devices()[0], "compute_capability", "9")).split(".")[0]
        big = ((cls.bwd_q, cls.bwd_k, cls.bwd_warps, cls.bwd_stages) if part == "dkdv"
               else (cls.dq_q, cls.dq_k, cls.dq_warps, cls.dq_stages))
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


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale,
                 block_q, block_k, slots):
    sq, sk, sv = slots
    rows_k = pl.ds(pl.multiple_of(pl.program_id(0) * block_k, block_k), block_k)
    k, v = _read(k_ref, rows_k, sk), _read(v_ref, rows_k, sv)
    c = scale * _LOG2E

    def body(i, carry):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q, do = _read(q_ref, rows, sq), do_ref[rows, :]
        # the transposed scores [block_k, block_q]: dK and dV then need no transpose
        p_t = jnp.exp2(_dot(k, q, trans_b=True) * c - lse_ref[rows][None, :])
        dv = dv + _dot(p_t, do)
        ds_t = p_t * (_dot(v, do, trans_b=True) - delta_ref[rows][None, :])
        return dk + _dot(ds_t, q), dv

    zeros = jnp.zeros((block_k, k.shape[1]), jnp.float32)
    dk, dv = lax.fori_loop(0, do_ref.shape[0] // block_q, body, (zeros, zeros))
    _write(dk_ref, rows_k, sk, dk * scale)
    _write(dv_ref, rows_k, sv, dv)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, block_q,
               block_k, slots):
    """dQ of one query block: loops over the key blocks, recomputing P and dS."""
    sq, sk, sv = slots
    rows_q = pl.ds(pl.multiple_of(pl.program_id(0) * block_q, block_q), block_q)
    q, do = _read(q_ref, rows_q, sq), do_ref[rows_q, :]
    lse, delta = lse_ref[rows_q], delta_ref[rows_q]
    c = scale * _LOG2E

    def body(j, dq):
        rows = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k = _read(k_ref, rows, sk)
        p = jnp.exp2(_dot(q, k, trans_b=True) * c - lse[:, None])
        ds = p * (_dot(do, _read(v_ref, rows, sv), trans_b=True) - delta[:, None])
        return dq + _dot(ds, k)

    dq = lax.fori_loop(0, k_ref.shape[0] // block_k, body,
                       jnp.zeros((block_q, q.shape[1]), jnp.float32))
    _write(dq_ref, rows_q, sq, dq * scale)


def _delta_kernel(o_ref, do_ref, delta_ref):
    """Each query row's sum(O * dO)."""
    delta_ref[...] = jnp.sum(o_ref[...] * do_ref[...], axis=1)


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


def _delta(o, do, interpret):
    b, t, n, h = do.shape
    bq = _tile(Blocks.fwd_q, t)
    rows = pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0))
    return pl.pallas_call(
        _delta_kernel, grid=(t // bq, b, n), in_specs=[rows, rows],
        out_specs=pl.BlockSpec((None, None, bq), lambda i, bi, ni: (bi, ni, i)),
        out_shape=jax.ShapeDtypeStruct((b, n, t), jnp.float32),
        interpret=interpret, name="jaxops_flash_bwd_delta_f32",
    )(o, do)


def _backward(operands, packed, o, lse, do, scale, interpret):
    """dK and dV (one program per key block), then dQ (one per query block)."""
    b, t, n, h = do.shape
    block_q, block_k, warps, stages = Blocks.bwd()
    bq, bk, slots = _tile(block_q, t), _tile(block_k, t), _slots(packed)
    delta = _delta(o, do, interpret)
    lse_spec = pl.BlockSpec((None, None, t), lambda *g: (g[-2], g[-1], 0))
    k_in = len(operands)
    seq, whole = _seq_spec(t, h), _seq_spec(t, h, packed)
    params = plgpu.CompilerParams(num_warps=warps, num_stages=stages)
    grad_shape = jax.ShapeDtypeStruct((b, t, 3, n, h) if packed else do.shape, jnp.float32)
    dkdv = functools.partial(_dkdv_kernel, scale=scale, block_q=bq, block_k=bk, slots=slots)

    def dkdv_body(*refs):
        ins, outs = refs[:k_in + 3], refs[k_in + 3:]
        dkdv(*(ins[:1] * 3 if packed else ins[:3]), *ins[k_in:], *(outs * 2 if packed else outs))

    n_out = 1 if packed else 2
    dk_dv = pl.pallas_call(
        dkdv_body, grid=(t // bk, b, n), in_specs=[whole] * k_in + [seq, lse_spec, lse_spec],
        out_specs=[whole] * n_out, out_shape=[grad_shape] * n_out, compiler_params=params,
        interpret=interpret, name="jaxops_flash_bwd_dkdv_f32")(*operands, do, lse, delta)
    block_q, block_k, warps, stages = Blocks.bwd("dq")
    bq, bk = _tile(block_q, t), _tile(block_k, t)
    dq_params = plgpu.CompilerParams(num_warps=warps, num_stages=stages)
    dq_kernel = functools.partial(_dq_kernel, scale=scale, block_q=bq, block_k=bk, slots=slots)

    def dq_body(*refs):
        ins = refs[:k_in + 3]
        dq_kernel(*(ins[:1] * 3 if packed else ins[:3]), *ins[k_in:], refs[-1])

    extra = dk_dv[:1] if packed else []  # packed: dQ goes into slot 0 of the same buffer
    dq = pl.pallas_call(
        dq_body, grid=(t // bq, b, n),
        in_specs=[whole] * k_in + [seq, lse_spec, lse_spec] + [whole] * len(extra),
        out_specs=whole, out_shape=grad_shape, compiler_params=dq_params,
        input_output_aliases={k_in + 3: 0} if packed else {},
        interpret=interpret, name="jaxops_flash_bwd_dq_f32")(*operands, do, lse, delta, *extra)
    return (dq,) if packed else (dq, *dk_dv)


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
