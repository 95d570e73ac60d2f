"""ConcatTraining and SplitTraining: pure copies.

Ideal traffic: read every input once, write every output once (2 * total bytes). Peers:
jnp.concatenate / jnp.split under jit, torch.cat / torch.split_with_sizes_copy (split's views
copied into fresh tensors, as the op's outputs are). Target for concat 8x[4096,1024] f32 along
axis 1: >= 85% of copy bandwidth (design notes: XLA 43%, PyTorch 80%).
"""
import functools
import math

import jax
import jax.numpy as jnp

from bench.harness import DTYPES, Case
from jaxops import ops
from jaxops.reference import concat as ref

FAMILY = "concat"


def _concat_case(dtype, n, shape, axis):
    jdt = DTYPES[dtype]
    shape = tuple(shape)

    def make(key):
        return tuple(jax.random.normal(k, shape, jnp.float32).astype(jdt)
                     for k in jax.random.split(key, n))

    def torch_cat(torch, *xs):
        return torch.cat(xs, dim=axis)

    return Case(
        name=f"concat_training/{dtype}/{n}x{'x'.join(map(str, shape))}/axis{axis}",
        family=FAMILY, op="concat_training", dtype=dtype, shape=(n, *shape),
        params={"axis": axis, "inputs": n}, make_inputs=make,
        jaxops=lambda *xs: ops.concat_training(*xs, axis=axis)[0],
        reference=lambda *xs: ref.concat(*xs, axis=axis).astype(jnp.float32),
        xla={"concatenate": lambda *xs: jnp.concatenate(xs, axis=axis)}, torch=torch_cat,
        bytes=2 * n * math.prod(shape) * jnp.dtype(jdt).itemsize)


def _split_case(dtype, shape, sizes, axis):
    jdt = DTYPES[dtype]
    shape, sizes = tuple(shape), tuple(sizes)

    def make(key):
        return (jax.random.normal(key, shape, jnp.float32).astype(jdt),)

    def torch_split(torch, x):
        if hasattr(torch, "split_with_sizes_copy"):
            return tuple(torch.split_with_sizes_copy(x, list(sizes), dim=axis))
        return tuple(t.contiguous() for t in torch.split(x, list(sizes), dim=axis))

    to_f32 = lambda outs: tuple(o.astype(jnp.float32) for o in outs)
    return Case(
        name=f"split_training/{dtype}/{'x'.join(map(str, shape))}/{len(sizes)}pieces/axis{axis}",
        family=FAMILY, op="split_training", dtype=dtype, shape=shape,
        params={"axis": axis, "sizes": list(sizes)}, make_inputs=make,
        jaxops=functools.partial(ops.split_training, split=sizes, axis=axis),
        reference=lambda x: to_f32(ref.split(x, sizes=sizes, axis=axis)),
        xla={"split": lambda x: tuple(ref.split(x, sizes=sizes, axis=axis))},
        torch=torch_split, bytes=2 * math.prod(shape) * jnp.dtype(jdt).itemsize)


def cases(quick: bool) -> list[Case]:
    rows, width = (256, 128) if quick else (4096, 1024)
    return [
        _concat_case("f32", 8, (rows, width), 1),  # the target shape
        _concat_case("bf16", 8, (rows, width), 1),
        _concat_case("f32", 8, (rows, width - 1), 1),  # rows not 16-byte multiples: 4-byte words
        _concat_case("f32", 8, (rows, width), 0),  # contiguous blocks
        _split_case("f32", (rows, 8 * width), [width] * 8, 1),
        _split_case("bf16", (rows, 8 * width), [width // 2, width * 3 // 2] * 4, 1),
    ]
