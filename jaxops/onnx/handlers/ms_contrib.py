"""Forward contrib ops that ORT's exporters and optimizers put in graphs (com.microsoft
Gelu family, SkipLayerNormalization, ...; ONNX-domain LayerNormalization and
SimplifiedLayerNormalization as ORT registers them below opset 17). Names that the training
registry (jaxops.ops.ORT_OPS) already maps are left to it."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import registry
from .activation import erf_gelu
from .norm import layer_norm

MS = "com.microsoft"


def _register(op_type, domain=MS, since=1):
    def wrap(fn):
        if registry.lookup(domain, op_type, since) is None:  # ORT_OPS wins
            registry.handler(op_type, since=since, domain=domain)(fn)
        return fn
    return wrap


def _tanh_gelu(x):
    return jax.nn.gelu(x, approximate=True).astype(x.dtype)


@_register("Gelu")
def gelu(ctx, x):
    return erf_gelu(x)


@_register("BiasGelu")
def bias_gelu(ctx, a, b):
    return erf_gelu(a + b)


@_register("FastGelu")
def fast_gelu(ctx, x, bias=None):
    return _tanh_gelu(x if bias is None else x + bias)


@_register("QuickGelu")
def quick_gelu(ctx, x, *, alpha=1.702):
    return (x * jax.nn.sigmoid(jnp.asarray(alpha, x.dtype) * x)).astype(x.dtype)


def _rms(x, scale, axis, epsilon):
    axes = tuple(range(axis % x.ndim, x.ndim))
    xs = x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(xs), axis=axes, keepdims=True) + epsilon)
    return (xs * inv).astype(x.dtype) * scale, inv


@_register("LayerNormalization", domain="", since=1)
def layer_norm_ort(ctx, x, scale, b=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    return layer_norm(ctx, x, scale, b, axis=axis, epsilon=epsilon, stash_type=stash_type)


@_register("SimplifiedLayerNormalization", domain="", since=1)
def simplified_layer_norm(ctx, x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    y, inv = _rms(x, scale, axis, epsilon)
    return (y, inv) if ctx.num_outputs > 1 else y


@_register("SkipLayerNormalization")
def skip_layer_norm(ctx, x, skip, gamma, beta=None, bias=None, *, epsilon=1e-12):
    s = x + skip if bias is None else x + skip + bias
    axes = (-1,)
    xs = s.astype(jnp.float32) if s.dtype in (jnp.float16, jnp.bfloat16) else s
    mean = jnp.mean(xs, axis=axes, keepdims=True)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(xs - mean), axis=axes, keepdims=True) + epsilon)
    y = ((xs - mean) * inv).astype(x.dtype) * gamma
    if beta is not None:
        y = y + beta
    outs = (y, mean, inv, s)
    return y if ctx.num_outputs == 1 else outs[: ctx.num_outputs]


@_register("SkipSimplifiedLayerNormalization")
def skip_simplified_layer_norm(ctx, x, skip, gamma, bias=None, *, epsilon=1e-12):
    s = x + skip if bias is None else x + skip + bias
    y, inv = _rms(s, gamma, -1, epsilon)
    outs = (y, None, inv, s)
    return y if ctx.num_outputs == 1 else outs[: ctx.num_outputs]
