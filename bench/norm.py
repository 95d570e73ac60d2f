"""LayerNormalizationGrad, SimplifiedLayerNormalizationGrad (RMSNorm) and BatchNormalizationGrad.

Ideal traffic: read dY and X, the per-row (or per-channel) statistics and scale; write X_grad
and the reduced outputs. Target (issue 6): layer_normalization_grad bf16 [16384,4096] with f32
statistics, all three outputs, >= 70% of copy bandwidth and faster than the XLA-compiled
reference and torch's native_layer_norm_backward. XLA peer: the reference (f32 math). torch:
aten.native_layer_norm_backward / aten.native_batch_norm_backward (no aten RMSNorm backward).
"""
import functools
import math

import jax
import jax.numpy as jnp

from bench.harness import DTYPES, Case
from jaxops import ops
from jaxops.reference import norm as ref

FAMILY = "norm"


def _shape_name(shape):
    return "x".join(map(str, shape))


def _f32(fn):
    """The reference on f32 casts of the inputs: the harness's oracle."""
    return lambda *a: fn(*[x.astype(jnp.float32) for x in a])


def ln_case(op, dtype, shape):
    m, n = shape
    jdt = DTYPES[dtype]
    simplified = op == "simplified_layer_normalization_grad"

    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        x = jax.random.normal(k1, shape, jnp.float32) * 1.5 + 0.2
        mean = jnp.mean(x, axis=-1, keepdims=True)
        c = x if simplified else x - mean
        inv = jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + 1e-5)
        dy = jax.random.normal(k2, shape, jnp.float32)
        scale = jax.random.uniform(k3, (n,), jnp.float32, 0.5, 1.5)
        if simplified:
            return dy.astype(jdt), x.astype(jdt), scale.astype(jdt), inv
        return dy.astype(jdt), x.astype(jdt), scale.astype(jdt), mean, inv

    item = jnp.dtype(jdt).itemsize
    n_out = 1 if simplified else 2
    nbytes = 3 * m * n * item + (1 if simplified else 2) * m * 4 + (1 + n_out) * n * item
    fn = getattr(ops, op)
    reference = getattr(ref, op)
    torch_call = None
    if not simplified:
        def torch_call(torch, dy, x, scale, mean, inv):
            return torch.ops.aten.native_layer_norm_backward(
                dy, x, [n], mean, inv, scale, torch.zeros_like(scale), [True, True, True])
    return Case(name=f"{op}/{dtype}-f32stats/{_shape_name(shape)}", family=FAMILY, op=op,
                dtype=dtype, shape=tuple(shape), params={"axis": -1}, make_inputs=make,
                jaxops=fn, reference=_f32(reference), xla={"ref": reference},
                torch=torch_call, bytes=nbytes)


def bn_case(dtype, shape):
    c = shape[1]
    jdt = DTYPES[dtype]

    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        x = jax.random.normal(k1, shape, jnp.float32) * 2 + 0.5
        axes = (0,) + tuple(range(2, len(shape)))
        mean = jnp.mean(x, axis=axes)
        inv = jax.lax.rsqrt(jnp.var(x, axis=axes) + 1e-5)
        dy = jax.random.normal(k2, shape, jnp.float32)
        scale = jax.random.uniform(k3, (c,), jnp.float32, 0.5, 1.5)
        return dy.astype(jdt), x.astype(jdt), scale, mean, inv

    def torch_call(torch, dy, x, scale, mean, inv):
        return torch.ops.aten.native_batch_norm_backward(
            dy, x, scale, None, None, mean, inv, True, 1e-5, [True, True, True])

    item = jnp.dtype(jdt).itemsize
    nbytes = 3 * math.prod(shape) * item + 5 * c * 4
    fn = functools.partial(ops.batch_normalization_grad, epsilon=1e-5)
    reference = ref.batch_normalization_grad
    return Case(name=f"batch_normalization_grad/{dtype}-f32stats/{_shape_name(shape)}",
                family=FAMILY, op="batch_normalization_grad", dtype=dtype, shape=tuple(shape),
                params={}, make_inputs=make, jaxops=fn, reference=_f32(reference),
                xla={"ref": reference}, torch=torch_call, bytes=nbytes)


def cases(quick: bool) -> list[Case]:
    if quick:
        ln, bn = (256, 512), (8, 16, 8, 8)
    else:
        ln, bn = (16384, 4096), (64, 256, 28, 28)
    return [ln_case("layer_normalization_grad", "bf16", ln),
            ln_case("layer_normalization_grad", "f32", ln),
            ln_case("simplified_layer_normalization_grad", "bf16", ln),
            bn_case("bf16", bn)]
