"""One attention's forward + backward on a GPU: the fused-attention rewrite's kernels against
the written-out formula.

    python -m bench.attention [--shapes 16x512x12x64,8x1024x12x64] [--sweep fwd|bwd]

Operands are float32 [B, T, N, H] (the 46M and 124M train-step benches' attention), products
in TF32 (jax's default on a GPU). Rows, ms a forward + backward (jax.vjp, one jit, bursts of
calls with one sync):
  written out   scores, softmax (SoftmaxGrad_13 kernel in the backward), product with V
  jax pallas    jax.experimental.pallas.ops.gpu.attention.mha (what the rewrite ran before)
  jaxops flash  jaxops/_src/flash_attention.py
  jaxops packed the same on one [B, T, 3, N, H] operand (a fused QKV projection's output; the
                row includes stacking Q, K, V into it and its gradient out of it)
  cudnn bf16    jax.nn.dot_product_attention on bf16 copies (cuDNN; the bf16 policy's kernel)
Each float32 row also prints its largest error against an IEEE float32 reference, scaled by
the reference's largest magnitude. --sweep times the flash kernel's tile settings instead.
"""
from __future__ import annotations

import argparse
import itertools
import re
import time

import jax
import jax.numpy as jnp

from bench.harness import burst_seconds
from jaxops._src import flash_attention as fa
from jaxops.onnx.handlers.fused_attention import _written_out


def _layouts(q, k, v):
    bnth = lambda x: jnp.swapaxes(x, 1, 2)
    return bnth(q), jnp.swapaxes(bnth(k), -1, -2), bnth(v)


def impls(scale):
    def written(q, k, v):
        q4, kt, v4 = _layouts(q, k, v)
        return jnp.swapaxes(_written_out(q4, kt, v4, scale, "Mul", None), 1, 2)

    def pallas(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention as pa
        blocks = pa.BlockSizes(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=64,
                               block_q_dq=64, block_kv_dq=64)
        return pa.mha(q, k, v, None, sm_scale=scale, block_sizes=blocks, num_warps=4,
                      num_stages=3)

    def cudnn(q, k, v):
        b = lambda x: x.astype(jnp.bfloat16)
        return jax.nn.dot_product_attention(b(q), b(k), b(v), scale=scale,
                                            implementation="cudnn")

    def packed(q, k, v):  # what a fused QKV projection's graph runs (the stack not timed apart)
        return fa.flash_attention_packed(jnp.stack([q, k, v], axis=2), scale)

    return {"written out": written, "jax pallas": pallas,
            "jaxops flash": lambda q, k, v: fa.flash_attention(q, k, v, scale),
            "jaxops packed": packed, "cudnn bf16": cudnn}


def _reference(q, k, v, do, scale):
    with jax.default_matmul_precision("float32"):
        def f(a, b, c):
            s = jnp.einsum("btnh,bsnh->bnts", a, b) * scale
            return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), c)
        out, vjp = jax.vjp(f, q, k, v)
        return jax.jit(lambda: (out, *vjp(do)))()


def _step(fn):
    def run(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do.astype(out.dtype)))
    return jax.jit(run)


def _ms(step, args):
    jax.block_until_ready(step(*args))
    one = time.perf_counter()
    jax.block_until_ready(step(*args))
    one = time.perf_counter() - one
    burst = max(5, min(200, int(0.2 / max(one, 1e-6))))
    return burst_seconds(lambda _: step(*args), jax.block_until_ready, burst, 5) * 1e3


def _error(got, want):
    return max(float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max())
               for g, w in zip(got, want))


def _operands(shape):
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(key, shape, jnp.float32) for key in keys]


def cases(quick):  # noqa: ARG001 (python -m bench's family protocol: its own command instead)
    return []


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16x512x12x64,8x1024x12x64")
    p.add_argument("--impls", help="comma-separated row names (default: all)")
    p.add_argument("--sweep", choices=["fwd", "bwd", "dkdv", "dq"],
                   help="bwd: both backward passes' tiles; dkdv, dq: one pass's alone")
    p.add_argument("--packed", action="store_true", help="sweep the packed-operand kernel")
    p.add_argument("--configs", help="sweep only these: q64k128w8s3,... (default: a grid)")
    args = p.parse_args(argv)
    for text in args.shapes.split(","):
        shape = tuple(int(d) for d in text.split("x"))
        ops = _operands(shape)
        scale = shape[-1] ** -0.5
        want = _reference(*ops, scale)
        print(f"[B, T, N, H] = {list(shape)}")
        if args.sweep:
            sweep(args.sweep, ops, scale, want, args.configs, args.packed)
            continue
        for name, fn in impls(scale).items():
            if args.impls and name not in args.impls.split(","):
                continue
            try:
                step = _step(fn)
                ms = _ms(step, ops)
                err = "" if name == "cudnn bf16" else f"  err {_error(step(*ops), want):.1e}"
                print(f"  {name:14s} {ms:8.3f} ms{err}", flush=True)
            except Exception as e:  # noqa: BLE001 - a row that fails is reported, not fatal
                print(f"  {name:14s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


def sweep(part, ops, scale, want, configs=None, packed=False):
    saved = dict(vars(fa.Blocks))
    grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3))
    if configs:
        grid = [tuple(int(x) for x in re.findall(r"\d+", c)) for c in configs.split(",")]
    for bq, bk, warps, stages in grid:
        if part == "fwd":
            fa.Blocks.fwd_q, fa.Blocks.fwd_k, fa.Blocks.fwd_warps, fa.Blocks.fwd_stages = (
                bq, bk, warps, stages)
        elif part == "dq":
            fa.Blocks.dq_q, fa.Blocks.dq_k, fa.Blocks.dq_warps, fa.Blocks.dq_stages = (
                bq, bk, warps, stages)
        else:
            fa.Blocks.bwd_q, fa.Blocks.bwd_k, fa.Blocks.bwd_warps, fa.Blocks.bwd_stages = (
                bq, bk, warps, stages)
        if part == "bwd":
            fa.Blocks.dq_q, fa.Blocks.dq_k, fa.Blocks.dq_warps, fa.Blocks.dq_stages = (
                bq, bk, warps, stages)
        label = f"q{bq} k{bk} w{warps} s{stages}"
        try:
            step = _step(impls(scale)["jaxops packed" if packed else "jaxops flash"])
            ms = _ms(step, ops)
            print(f"  {part} {label:16s} {ms:8.3f} ms  err {_error(step(*ops), want):.1e}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  {part} {label:16s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        for key, value in saved.items():
            if not key.startswith("__"):
                setattr(fa.Blocks, key, value)


if __name__ == "__main__":
    main()
