"""Convolutions: Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv is not covered."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from jaxops._src import geometry
from jaxops.ops.conv import conv_general

from ..registry import handler


def _dims(nd):
    sp = "DHW"[-nd:] if nd <= 3 else None
    if sp is None:
        raise ValueError(f"Conv: {nd} spatial dims are not supported")
    return ("NC" + sp, "OI" + sp, "NC" + sp)


@handler("Conv")
def conv(ctx, x, w, b=None, **attrs):
    return with_bias(convolve(ctx, x, w, **attrs), b)


def with_bias(y, b):
    """y [N, C, ...] + b [C] (b None: y)."""
    return y if b is None else y + b.reshape((-1,) + (1,) * (y.ndim - 2))


def convolve(ctx, x, w, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
             pads=None, strides=None, epilogue=None):
    """Conv's convolution without its bias (and with the fused Conv's epilogue)."""
    nd = x.ndim - 2
    kernel = list(kernel_shape or w.shape[2:])
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    padding = geometry.padding(auto_pad, x.shape[2:], kernel, strides, dilations, pads)
    _dims(nd)  # rank check
    # grouped, depthwise, 1x1 and stem convolutions: a formulation that XLA:CPU runs well, on
    # the CPU only (the gradient of a training graph is ConvGrad's, which keeps XLA's dense ones).
    # The channels-last form there where no ConvGrad reads the activations: a constant weight
    # (program.jit() closes over the params) or a graph without ConvGrad (an eval model, as
    # Module.eval runs); in a training graph the NCHW form, whose activations its gradient ops
    # read as they lie (channels last there: train steps 1.01-1.11x the time)
    return conv_general(x, w.astype(x.dtype), strides, padding, dilations, group,
                        precision=None, dense=True,
                        channels_last=ctx.is_static(w) or not ctx.graph_has("ConvGrad"),
                        epilogue=epilogue, constant_w=ctx.is_static(w))


@handler("ConvTranspose")
def conv_transpose(ctx, x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1,
                   kernel_shape=None, output_padding=None, output_shape=None, pads=None,
                   strides=None):
    nd = x.ndim - 2
    kernel = list(kernel_shape or w.shape[2:])
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    out_pad = list(output_padding or [0] * nd)
    spans = geometry.windows(kernel, dilations)
    if output_shape is not None:
        output_shape = list(output_shape)[-nd:]
    crops = geometry.conv_transpose_crops(auto_pad, x.shape[2:], strides, spans, out_pad, pads,
                                          output_shape)
    # transposed conv = conv of the stride-dilated input with the flipped, in/out-swapped kernel
    cin = w.shape[0]
    cout_g = w.shape[1]
    k = w.reshape((group, cin // group, cout_g) + w.shape[2:])
    k = jnp.swapaxes(k, 1, 2).reshape((group * cout_g, cin // group) + w.shape[2:])
    k = jnp.flip(k, axis=tuple(range(2, 2 + nd)))
    padding = [(f - 1 - lo, f - 1 - hi + a) for f, (lo, hi), a in zip(spans, crops, out_pad)]
    _dims(nd)  # rank check
    y = conv_general(x, k.astype(x.dtype), [1] * nd, padding, dilations, group,
                     lhs_dilation=strides, precision=None)
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
    padding = geometry.padding(attrs.get("auto_pad", "NOTSET"), x.shape[2:], kernel, strides,
                               dilations, attrs.get("pads"))
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
    y = conv_general(padded, jnp.asarray(weight).astype(x.dtype), [1], [(0, 0)], [1], c,
                     precision=None)
    if bias is not None:
        y = y + bias.reshape(-1, 1)
    if activation in ("silu", "swish"):
        y32 = y.astype(jnp.float32)
        y = (y32 * jax.nn.sigmoid(y32)).astype(x.dtype)
    return y.astype(x.dtype), padded[:, :, padded.shape[2] - (k - 1):]


@handler("Col2Im", since=18)
def col2im(ctx, x, image_shape, block_shape, *, dilations=None, pads=None, strides=None):
    """[N, C*prod(block), L] columns summed back into [N, C, *image] (the inverse of im2col);
    the scatter index table is static."""
    image = [int(v) for v in ctx.static(image_shape, "image_shape")]
    block = [int(v) for v in ctx.static(block_shape, "block_shape")]
    nd = len(image)
    dilations = list(dilations or [1] * nd)
    strides = list(strides or [1] * nd)
    pads = list(pads or [0] * (2 * nd))
    counts = [(image[i] + pads[i] + pads[i + nd] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
              for i in range(nd)]
    # image position of every (block offset, column) pair, per spatial dim
    flat = np.zeros([1] * (2 * nd), np.int64)
    valid = np.ones([1] * (2 * nd), bool)
    for i in range(nd):
        shape = [1] * (2 * nd)
        shape[i], shape[nd + i] = block[i], counts[i]
        pos = (np.arange(block[i])[:, None] * dilations[i] + np.arange(counts[i])[None, :] * strides[i]
               - pads[i]).reshape(shape)
        valid = valid & (pos >= 0) & (pos < image[i])
        flat = flat * image[i] + np.clip(pos, 0, image[i] - 1)
    flat = np.where(valid, flat, int(np.prod(image))).reshape(-1)  # out of range: dropped
    n = x.shape[0]
    c = x.shape[1] // int(np.prod(block))
    cols = jnp.asarray(x).reshape(n, c, -1)
    out = jnp.zeros((n, c, int(np.prod(image))), x.dtype).at[:, :, flat].add(cols, mode="drop")
    return out.reshape((n, c) + tuple(image))


@handler("DeformConv", since=19)
def deform_conv(ctx, x, w, offset, b=None, mask=None, *, dilations=None, group=1,
                kernel_shape=None, offset_group=1, pads=None, strides=None):
    """2-D deformable convolution: each kernel tap samples the input bilinearly (zero outside)
    at its regular position plus a learned offset, times an optional mask."""
    n, c, ih, iw = x.shape
    kh, kw = kernel_shape or w.shape[2:]
    sh, sw = strides or (1, 1)
    dh, dw = dilations or (1, 1)
    pt, pl = (pads or (0, 0, 0, 0))[:2]
    oh, ow = offset.shape[2:]
    g = offset_group
    off = jnp.asarray(offset).reshape(n, g, kh, kw, 2, oh, ow)
    ys = (np.arange(oh) * sh - pt)[None, None, :, None] + (np.arange(kh) * dh)[:, None, None, None]
    xs = (np.arange(ow) * sw - pl)[None, None, None, :] + (np.arange(kw) * dw)[None, :, None, None]
    py = off[:, :, :, :, 0] + ys  # [N, G, kh, kw, oh, ow]
    px = off[:, :, :, :, 1] + xs
    y0, x0 = jnp.floor(py), jnp.floor(px)
    xg = jnp.asarray(x).reshape(n, g, c // g, ih * iw)
    sampled = 0
    for cy, cx in ((0, 0), (0, 1), (1, 0), (1, 1)):
        yy, xx = y0 + cy, x0 + cx
        wgt = (1 - jnp.abs(py - yy)) * (1 - jnp.abs(px - xx))
        inside = (yy >= 0) & (yy < ih) & (xx >= 0) & (xx < iw)
        idx = (jnp.clip(yy, 0, ih - 1) * iw + jnp.clip(xx, 0, iw - 1)).astype(jnp.int32)
        vals = jnp.take_along_axis(xg, idx.reshape(n, g, 1, -1), axis=-1)  # [N, G, C/G, K*oh*ow]
        sampled = sampled + vals * jnp.where(inside, wgt, 0).reshape(n, g, 1, -1).astype(x.dtype)
    if mask is not None:
        sampled = sampled * jnp.asarray(mask).reshape(n, g, 1, -1)
    cols = sampled.reshape(n, group, c // group, kh * kw, oh, ow)
    wk = jnp.asarray(w).reshape(group, w.shape[0] // group, c // group, kh * kw)
    y = jnp.einsum("ngckhw,gock->ngohw", cols, wk.astype(x.dtype)).reshape(n, -1, oh, ow)
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return y.astype(x.dtype)
