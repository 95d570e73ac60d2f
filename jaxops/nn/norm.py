"""layer_norm and rms_norm whose backward passes run ORT's gradient kernels.

Both are `jax.custom_jvp`: the forward pass is XLA's (it fuses into its neighbours) and keeps
the per-row mean (layer_norm) and inverse std in f32 (f64 for f64 inputs); the tangent map
(`ops.norm.ln_jvp`, XLA code) is linear in the tangents of x, scale and bias, and its transpose
is one LayerNormalizationGrad / SimplifiedLayerNormalizationGrad call giving all three
gradients. So forward mode works and reverse mode runs the kernels; higher-order gradients
differentiate those ops through their references. The output has x's dtype; `axis` is the
first normalised dim (ORT's convention: every dim from `axis` on is normalised) and scale/bias
hold x.shape[axis:] values.
"""
import functools

import jax
import jax.numpy as jnp

from jaxops.ops import norm as ops
from jaxops.reference import norm as ref

__all__ = ["layer_norm", "rms_norm"]


def _stats(x, axis, epsilon, rms):
    a = ref.acc_dtype(x.dtype)
    axes = tuple(range(axis % x.ndim, x.ndim))
    xs = x.astype(a)
    mean = None if rms else jnp.mean(xs, axis=axes, keepdims=True)
    centred = xs if rms else xs - mean
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=axes, keepdims=True)
                        + jnp.asarray(epsilon, a))
    return xs, centred, mean, inv


def _apply(x, centred, inv, scale, bias, axis):
    feat = x.shape[axis % x.ndim:]
    y = centred * inv * scale.astype(centred.dtype).reshape(feat)
    if bias is not None:
        y = y + bias.astype(centred.dtype).reshape(feat)
    return y.astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def layer_norm(x, scale, bias, axis=-1, epsilon=1e-5):
    """(x - mean) / sqrt(var + epsilon) * scale + bias over the dims from `axis` on (bias may
    be None); backward pass = LayerNormalizationGrad."""
    _, centred, _, inv = _stats(x, axis, epsilon, rms=False)
    return _apply(x, centred, inv, scale, bias, axis)


@layer_norm.defjvp
def _layer_norm_jvp(axis, epsilon, primals, tangents):
    (x, scale, bias), (tx, ts, tb) = primals, tangents
    _, centred, mean, inv = _stats(x, axis, epsilon, rms=False)
    y = _apply(x, centred, inv, scale, bias, axis)
    return y, ops.ln_jvp(ref.LAYER, tx, ts, tb, x, scale, mean, inv, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def rms_norm(x, scale, axis=-1, epsilon=1e-5):
    """x / sqrt(mean(x^2) + epsilon) * scale over the dims from `axis` on;
    backward pass = SimplifiedLayerNormalizationGrad."""
    _, centred, _, inv = _stats(x, axis, epsilon, rms=True)
    return _apply(x, centred, inv, scale, None, axis)


@rms_norm.defjvp
def _rms_norm_jvp(axis, epsilon, primals, tangents):
    (x, scale), (tx, ts) = primals, tangents
    _, centred, _, inv = _stats(x, axis, epsilon, rms=True)
    y = _apply(x, centred, inv, scale, None, axis)
    return y, ops.ln_jvp(ref.SIMPLIFIED, tx, ts, None, x, scale, None, inv, axis)
