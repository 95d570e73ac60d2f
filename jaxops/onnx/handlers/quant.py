"""Quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from ..registry import handler
from ._precise import in_float64
from ._util import np_dtype, norm_axis
from .elementwise import cast_to


# XLA's f32 division is not correctly rounded on CPU, and a quotient landing an ulp off .5
# then rounds the other way: the f32 quotient of an f64 division is numpy's f32 division
_divide = in_float64(jnp.divide)


def _expand_param(p, x, axis, block_size):
    """Broadcasts a scale/zero-point (scalar, per-axis 1-D, or blocked) against x."""
    p = jnp.asarray(p)
    if p.ndim == 0 or p.size == 1 and x.ndim != p.ndim:
        return p.reshape(())
    axis = norm_axis(axis, x.ndim)
    if block_size:
        p = jnp.repeat(p, block_size, axis=axis)
        return jnp.take(p, jnp.arange(x.shape[axis]), axis=axis)
    if p.ndim == 1:
        return p.reshape([-1 if d == axis else 1 for d in range(x.ndim)])
    return p


def quantize(x, scale, zp, to, axis=1, block_size=0, saturate=1):
    s = _expand_param(scale, x, axis, block_size)
    if x.dtype == jnp.float64:
        q = x / s
    else:
        q = _divide(x.astype(jnp.float32), s.astype(jnp.float32))
    to = np.dtype(to)
    if jnp.issubdtype(to, jnp.integer):
        q = jnp.round(q)
        if zp is not None:
            q = q + _expand_param(zp, x, axis, block_size).astype(q.dtype)
        info = jnp.iinfo(to)
        return jnp.clip(q, info.min, info.max).astype(to)
    if zp is not None:
        q = q + _expand_param(zp, x, axis, block_size).astype(q.dtype)
    return cast_to(q, to, saturate)


@handler("QuantizeLinear", since=10)
def quantize_linear(ctx, x, y_scale, y_zero_point=None, *, axis=1, saturate=1, block_size=0,
                    output_dtype=0, precision=0):
    if y_zero_point is not None:
        to = y_zero_point.dtype
    elif output_dtype:
        to = np_dtype(output_dtype)
    else:
        to = np.uint8
    return quantize(x, y_scale, y_zero_point, to, axis, block_size, saturate)


@handler("DequantizeLinear", since=10)
def dequantize_linear(ctx, x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0):
    s = _expand_param(x_scale, x, axis, block_size)
    v = jnp.asarray(x).astype(jnp.float32)
    if x_zero_point is not None:
        v = v - _expand_param(x_zero_point, x, axis, block_size).astype(jnp.float32)
    out = np_dtype(output_dtype) if output_dtype else np.dtype(jnp.asarray(x_scale).dtype)
    return (v * s.astype(jnp.float32)).astype(out)


@handler("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(ctx, x):
    lo = jnp.minimum(jnp.min(x), 0)
    hi = jnp.maximum(jnp.max(x), 0)
    scale = _divide((hi - lo).astype(jnp.float32), np.float32(255))
    zp = jnp.clip(jnp.round(_divide(-lo.astype(jnp.float32), scale)), 0, 255).astype(jnp.uint8)
    return quantize(x, scale, zp, np.uint8), scale, zp


@handler("QLinearMatMul", since=10)
def qlinear_matmul(ctx, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp):
    ai = jnp.asarray(a).astype(jnp.int32) - jnp.asarray(a_zp).astype(jnp.int32)
    bi = jnp.asarray(b).astype(jnp.int32) - jnp.asarray(b_zp).astype(jnp.int32)
    acc = jnp.matmul(ai, bi, preferred_element_type=jnp.int32).astype(jnp.float32)
    real = acc * (jnp.asarray(a_scale, jnp.float32) * jnp.asarray(b_scale, jnp.float32))
    return quantize(real, y_scale, y_zp, np.dtype(y_zp.dtype))
