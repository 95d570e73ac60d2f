"""GatherGrad: the embedding gradient dX = zeros([V, D]); dX[ids[p]] += dY[p].

Ideal traffic: read dY (N*D), read the ids (N*4), write dX (V*D). XLA peer: the reference
(a scatter-add in f32, rounded once; a bf16 scatter-add fails the check on Zipf ids).
torch: `torch.ops.aten.embedding_dense_backward` (PyTorch's own sorted, deterministic path).

Targets (issue #3, on an H200): bf16 V=50304 D=1024 N=16384 with Zipf(1.2) ids >= 50x the XLA
reference and >= 2x PyTorch (0.28 ms); f32 V=1024 D=1024 N=65536 (uniform ids, about 64
duplicates a row) >= 40% of copy bandwidth. Issue 24: f32 at least as fast as XLA's scatter at
every shape; bf16 V=1024 D=1024 N=65536 >= 40% of copy bandwidth.
"""
import functools

import jax
import jax.numpy as jnp

from bench.harness import DTYPES, Case
from jaxops import ops
from jaxops.reference import gather as ref

FAMILY = "gather"


def _ids(key, n, v, zipf):
    """n ids in [0, v): Zipf-distributed (P(k) ~ (k+1)^-zipf) or uniform when zipf is None."""
    if zipf is None:
        return jax.random.randint(key, (n,), 0, v, jnp.int32)
    cdf = jnp.cumsum(jnp.arange(1, v + 1, dtype=jnp.float32) ** -zipf)
    u = jax.random.uniform(key, (n,), jnp.float32) * cdf[-1]
    return jnp.minimum(jnp.searchsorted(cdf, u), v - 1).astype(jnp.int32)


def _make_inputs(n, v, d, dtype, zipf):
    def make(key):
        k1, k2 = jax.random.split(key)
        return _ids(k1, n, v, zipf), jax.random.normal(k2, (n, d), jnp.float32).astype(dtype)
    return make


def case(dtype, v, d, n, zipf=None):
    jdt = DTYPES[dtype]
    shape = (v, d)
    xla = {"ref": lambda ids, dy: ref.gather_grad(shape, ids, dy)}
    dist = "uniform" if zipf is None else f"zipf{zipf}"
    return Case(
        name=f"gather_grad/{dtype}/V{v}xD{d}/N{n}/{dist}", family=FAMILY, op="gather_grad",
        dtype=dtype, shape=(v, d, n), params={"axis": 0, "ids": dist},
        make_inputs=_make_inputs(n, v, d, jdt, zipf),
        jaxops=functools.partial(ops.gather_grad, shape),
        reference=lambda ids, dy: ref.gather_grad(shape, ids, dy.astype(jnp.float32)),
        xla=xla,
        torch=lambda torch, ids, dy: torch.ops.aten.embedding_dense_backward(dy, ids, v, -1,
                                                                             False),
        bytes=(n * d + v * d) * jnp.dtype(jdt).itemsize + n * 4)


def cases(quick: bool) -> list[Case]:
    if quick:
        return [case("bf16", 5000, 128, 1024, zipf=1.2), case("f32", 128, 128, 4096)]
    return [case("bf16", 50304, 1024, 16384, zipf=1.2), case("bf16", 1024, 1024, 65536),
            case("f32", 1024, 1024, 65536), case("f32", 50304, 1024, 16384, zipf=1.2)]
