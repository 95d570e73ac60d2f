"""Float32 flash attention for a GPU, written in Pallas (Triton): softmax(scale Q K^T) V without
a [T, S] matrix in memory, forward and backward.

Operands are [batch, seq, heads, head] (the layout a QKV projection's output already has, so
the graph's transposes around attention cancel). cuDNN's flash attention takes f16/bf16 only;
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_LOG2E = math.log2(math.e)


class Blocks:
    """Tile sizes and Triton settings (measured on an H100: docs/performance.md)."""
    fwd_q, fwd_k, fwd_warps, fwd_stages = 128, 64, 4, 3
    bwd_q, bwd_k, bwd_warps, bwd_stages = 128, 128, 8, 1


def applies(q, k, v) -> bool:
    """Whether the kernels take these [B, T, N, H] operands: float32 on a GPU, one shape for
    all three, T a multiple of 64, a power-of-2 head size from 16 to 128."""
    b, t, n, h = q.shape
    return (jax.default_backend() == "gpu" and q.dtype == k.dtype == v.dtype == jnp.float32
            and q.shape == k.shape == v.shape and t % 64 == 0 and h in (16, 32, 64, 128))


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_k):
    q = q_ref[...]
    block_q, head = q.shape
    c = scale * _LOG2E

    def body(j, carry):
        acc, m, l = carry
        rows = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        s = plgpu.dot(q, k_ref[rows, :], trans_b=True) * c
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - m_new[:, None])
        shrink = jnp.exp2(m - m_new)
        acc = acc * shrink[:, None] + plgpu.dot(p, v_ref[rows, :])
        return acc, m_new, l * shrink + p.sum(axis=1)

    init = (jnp.zeros((block_q, head), jnp.float32),
            jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    acc, m, l = lax.fori_loop(0, k_ref.shape[0] // block_k, body, init)
    o_ref[...] = acc / l[:, None]
    lse_ref[...] = m + jnp.log2(l)


def _bwd_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_in_ref,
                dq_ref, dk_ref, dv_ref, *, scale, block_q):
    del dq_in_ref  # the zeroed buffer dq_ref aliases
    k, v = k_ref[...], v_ref[...]
    block_k, head = k.shape
    c = scale * _LOG2E

    n_q = q_ref.shape[0] // block_q
    first = pl.program_id(0)  # each key block starts at its own query block: the dQ atomics
    # of concurrent programs land on different rows (3-12% faster than all starting at 0)

    def body(i, carry):
        dk, dv = carry
        i = lax.rem(i.astype(jnp.int32) + first, jnp.int32(n_q))
        rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q, do = q_ref[rows, :], do_ref[rows, :]
        # the transposed scores [block_k, block_q]: dK and dV then need no transpose
        p_t = jnp.exp2(plgpu.dot(k, q, trans_b=True) * c - lse_ref[rows][None, :])
        dv = dv + plgpu.dot(p_t, do)
        ds_t = p_t * (plgpu.dot(v, do, trans_b=True) - delta_ref[rows][None, :])
        dk = dk + plgpu.dot(ds_t, q)
        plgpu.atomic_add(dq_ref, (rows, pl.ds(jnp.int32(0), head)), plgpu.dot(ds_t, k, trans_a=True) * scale)
        return dk, dv

    zeros = jnp.zeros((block_k, head), jnp.float32)
    dk, dv = lax.fori_loop(0, n_q, body, (zeros, zeros))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _tile(size, t):
    """The tile size where it divides T, else 64 (applies() asks T to be a multiple of 64)."""
    return size if t % size == 0 else 64


def _seq_spec(t, h):
    """One (batch, head)'s whole [T, H] slice."""
    return pl.BlockSpec((None, t, None, h), lambda *g: (g[-2], 0, g[-1], 0))


def _forward(q, k, v, scale, interpret=False):
    b, t, n, h = q.shape
    bq = _tile(Blocks.fwd_q, t)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, block_k=_tile(Blocks.fwd_k, t)),
        grid=(t // bq, b, n),
        in_specs=[pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
                  _seq_spec(t, h), _seq_spec(t, h)],
        out_specs=[pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, bi, ni: (bi, ni, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32),
                   jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=Blocks.fwd_warps,
                                             num_stages=Blocks.fwd_stages),
        interpret=interpret, name="jaxops_flash_fwd_f32",
    )(q, k, v)


def _backward(q, k, v, o, lse, do, scale, interpret=False):
    b, t, n, h = q.shape
    bk = _tile(Blocks.bwd_k, t)
    delta = jnp.einsum("btnh,btnh->bnt", o, do, precision=lax.Precision.HIGHEST)
    lse_spec = pl.BlockSpec((None, None, t), lambda j, bi, ni: (bi, ni, 0))
    kv_block = pl.BlockSpec((None, bk, None, h), lambda j, bi, ni: (bi, j, ni, 0))
    dq, dk, dv = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale, block_q=_tile(Blocks.bwd_q, t)),
        grid=(t // bk, b, n),
        in_specs=[_seq_spec(t, h), kv_block, kv_block, _seq_spec(t, h), lse_spec, lse_spec,
                  _seq_spec(t, h)],
        out_specs=[_seq_spec(t, h), kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32)] * 3,
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=Blocks.bwd_warps,
                                             num_stages=Blocks.bwd_stages),
        interpret=interpret, name="jaxops_flash_bwd_f32",
    )(q, k, v, do, lse, delta, jnp.zeros(q.shape, jnp.float32))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def flash_attention(q, k, v, scale: float, interpret: bool = False):
    """softmax(scale * Q K^T) V for float32 [B, T, N, H] operands (see applies()); interpret
    runs the kernels in Pallas' interpreter (any backend: for tests)."""
    return _forward(q, k, v, scale, interpret)[0]


def _fwd_rule(q, k, v, scale, interpret):
    o, lse = _forward(q, k, v, scale, interpret)
    return o, (q, k, v, o, lse)


def _bwd_rule(scale, interpret, res, do):
    return _backward(*res, do, scale, interpret)


flash_attention.defvjp(_fwd_rule, _bwd_rule)
