"""layer_norm and rms_norm whose backward passes run ORT's gradient kernels.

Both are `jax.custom_vjp`: the forward pass is XLA's (it fuses into its neighbours) and saves
the per-row mean (layer_norm) and inverse std in f32 (f64 for f64 inputs); the backward pass is
LayerNormalizationGrad / SimplifiedLayerNormalizationGrad. Higher-order gradients differentiate
those ops through their references. The output has x's dtype; `axis` is the first normalised
dim (ORT's convention: every dim from `axis` on is normalised) and scale/bias hold
x.shape[axis:] values.
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x, scale, bias, axis=-1, epsilon=1e-5):
    """(x - mean) / sqrt(var + epsilon) * scale + bias over the dims from `axis` on;
    backward pass = LayerNormalizationGrad."""
    _, centred, _, inv = _stats(x, axis, epsilon, rms=False)
    return _apply(x, centred, inv, scale, bias, axis)


def _layer_norm_fwd(x, scale, bias, axis, epsilon):
    _, centred, mean, inv = _stats(x, axis, epsilon, rms=False)
    return _apply(x, centred, inv, scale, bias, axis), (x, scale, bias, mean, inv)


def _layer_norm_bwd(axis, epsilon, res, dy):
    x, scale, bias, mean, inv = res
    dx, dscale, dbias = ops.ln_grad(ref.LAYER, dy, x, scale, None, mean, inv, axis)
    return dx, dscale, dbias.reshape(bias.shape).astype(bias.dtype)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x, scale, axis=-1, epsilon=1e-5):
    """x / sqrt(mean(x^2) + epsilon) * scale over the dims from `axis` on;
    backward pass = SimplifiedLayerNormalizationGrad."""
    _, centred, _, inv = _stats(x, axis, epsilon, rms=True)
    return _apply(x, centred, inv, scale, None, axis)


def _rms_norm_fwd(x, scale, axis, epsilon):
    _, centred, _, inv = _stats(x, axis, epsilon, rms=True)
    return _apply(x, centred, inv, scale, None, axis), (x, scale, inv)


def _rms_norm_bwd(axis, epsilon, res, dy):
    x, scale, inv = res
    dx, dscale, _ = ops.ln_grad(ref.SIMPLIFIED, dy, x, scale, None, None, inv, axis)
    return dx, dscale


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
