"""Convolutions: Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv is not covered."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from ..registry import handler


def same_pads(in_sizes, kernel, strides, dilations, auto_pad):
    """Explicit (begin, end) pads for SAME_UPPER/SAME_LOWER: output = ceil(in / stride)."""
    pads = []
    for n, k, s, d in zip(in_sizes, kernel, strides, dilations):
        out = -(-n // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
        small = total // 2
        pads.append((small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small))
    return pads


def resolve_pads(in_sizes, kernel, strides, dilations, pads, auto_pad):
    nd = len(kernel)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return same_pads(in_sizes, kernel, strides, dilations, auto_pad)
    if auto_pad == "VALID" or pads is None:
        return [(0, 0)] * nd
    return [(pads[i], pads[i + nd]) for i in range(nd)]


def _dims(nd):
    sp = "DHW"[-nd:] if nd <= 3 else None
    if sp is None:
        raise ValueError(f"Conv: {nd} spatial dims are not supported")
    return ("NC" + sp, "OI" + sp, "NC" + sp)


@handler("Conv")
def conv(ctx, x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
         pads=None, strides=None):
    nd = x.ndim - 2
    kernel = list(kernel_shape or w.shape[2:])
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    padding = resolve_pads(x.shape[2:], kernel, strides, dilations, pads, auto_pad)
    y = lax.conv_general_dilated(
        x, w.astype(x.dtype), strides, padding, rhs_dilation=dilations,
        dimension_numbers=_dims(nd), feature_group_count=group)
    if b is not None:
        y = y + b.reshape((-1,) + (1,) * nd)
    return y


@handler("ConvTranspose")
def conv_transpose(ctx, x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1,
                   kernel_shape=None, output_padding=None, output_shape=None, pads=None,
                   strides=None):
    nd = x.ndim - 2
    kernel = list(kernel_shape or w.shape[2:])
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    out_pad = list(output_padding or [0] * nd)
    ins = x.shape[2:]
    full = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if output_shape is not None:
        output_shape = list(output_shape)[-nd:]
    if output_shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        output_shape = [n * s for n, s in zip(ins, strides)]
    if output_shape is not None:
        pad_pairs = []
        for i in range(nd):
            # a negative total (output_shape larger than the natural size) extends the end
            total = strides[i] * (ins[i] - 1) + out_pad[i] + full[i] - output_shape[i]
            half = int(total / 2)
            pad_pairs.append((total - half, half) if auto_pad == "SAME_LOWER" else (half, total - half))
    elif pads is not None and auto_pad == "NOTSET":
        pad_pairs = [(pads[i], pads[i + nd]) for i in range(nd)]
    else:
        pad_pairs = [(0, 0)] * nd
    # transposed conv = conv of the stride-dilated input with the flipped, in/out-swapped kernel
    cin = w.shape[0]
    cout_g = w.shape[1]
    k = w.reshape((group, cin // group, cout_g) + w.shape[2:])
    k = jnp.swapaxes(k, 1, 2).reshape((group * cout_g, cin // group) + w.shape[2:])
    k = jnp.flip(k, axis=tuple(range(2, 2 + nd)))
    padding = [(full[i] - 1 - lo, full[i] - 1 - hi + out_pad[i]) for i, (lo, hi) in enumerate(pad_pairs)]
    y = lax.conv_general_dilated(
        x, k.astype(x.dtype), [1] * nd, padding, lhs_dilation=strides, rhs_dilation=dilations,
        dimension_numbers=_dims(nd), feature_group_count=group)
    if output_shape is not None:
        y = y[(slice(None), slice(None)) + tuple(slice(0, s) for s in output_shape)]
    if b is not None:
        y = y + b.reshape((-1,) + (1,) * nd)
    return y


def _int_conv(x, w, xz, wz, **attrs):
    xi = jnp.asarray(x).astype(jnp.int32) - (0 if xz is None else jnp.asarray(xz).astype(jnp.int32))
    wi = jnp.asarray(w).astype(jnp.int32)
    if wz is not None:
        wz = jnp.asarray(wz).astype(jnp.int32)
        wi = wi - (wz.reshape((-1,) + (1,) * (w.ndim - 1)) if wz.ndim == 1 else wz)
    nd = x.ndim - 2
    kernel = list(attrs.get("kernel_shape") or w.shape[2:])
    strides = list(attrs.get("strides") or [1] * nd)
    dilations = list(attrs.get("dilations") or [1] * nd)
    padding = resolve_pads(x.shape[2:], kernel, strides, dilations, attrs.get("pads"),
                           attrs.get("auto_pad", "NOTSET"))
    return lax.conv_general_dilated(
        xi, wi, strides, padding, rhs_dilation=dilations, dimension_numbers=_dims(nd),
        feature_group_count=attrs.get("group", 1), preferred_element_type=jnp.int32)


@handler("ConvInteger", since=10)
def conv_integer(ctx, x, w, x_zero_point=None, w_zero_point=None, **attrs):
    return _int_conv(x, w, x_zero_point, w_zero_point, **attrs)


@handler("QLinearConv", since=10)
def qlinear_conv(ctx, x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, b=None, **attrs):
    acc = _int_conv(x, w, x_zp, w_zp, **attrs)
    if b is not None:
        acc = acc + b.reshape((-1,) + (1,) * (x.ndim - 2))
    ws = jnp.asarray(w_scale, jnp.float32)
    ws = ws.reshape((-1,) + (1,) * (x.ndim - 2)) if ws.ndim == 1 else ws
    real = acc.astype(jnp.float32) * (jnp.asarray(x_scale, jnp.float32) * ws)
    from .quant import quantize
    return quantize(real, y_scale, y_zp, np.dtype(y_zp.dtype))


@handler("CausalConvWithState", since=27)
def causal_conv_with_state(ctx, x, weight, bias=None, past_state=None, *, activation="none"):
    """Depthwise causal 1-D conv over [B, C, L], carrying the last k-1 inputs as state."""
    b, c, _ = x.shape
    k = weight.shape[2]
    pad = jnp.zeros((b, c, k - 1), x.dtype) if past_state is None else jnp.asarray(past_state)
    padded = jnp.concatenate([pad, jnp.asarray(x)], axis=2)
    y = lax.conv_general_dilated(padded, jnp.asarray(weight).astype(x.dtype), [1], [(0, 0)],
                                 dimension_numbers=_dims(1), feature_group_count=c)
    if bias is not None:
        y = y + bias.reshape(-1, 1)
    if activation in ("silu", "swish"):
        y32 = y.astype(jnp.float32)
        y = (y32 * jax.nn.sigmoid(y32)).astype(x.dtype)
    return y.astype(x.dtype), padded[:, :, padded.shape[2] - (k - 1):]
