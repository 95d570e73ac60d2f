"""Pooling: MaxPool (with Indices), AveragePool, LpPool, Global*Pool, MaxUnpool.

Windows are gathered through a static index table (numpy), which handles padding, dilation
and ceil_mode the same way for every pool and stays differentiable."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from jaxops._src import geometry

from ..registry import handler


def _windows(in_sizes, kernel, strides, dilations, pads, ceil_mode):
    """(flat index into the unpadded spatial input or -1 for padding) [outputs, window] and
    the output spatial shape."""
    axes_pos, out_shape = [], []
    for n, k, s, d, (pb, pe) in zip(in_sizes, kernel, strides, dilations, pads):
        out = geometry.pool_output_size(n, (k - 1) * d + 1, s, pb, pe, ceil_mode)
        pos = (np.arange(out) * s)[:, None] + (np.arange(k) * d)[None, :] - pb  # [out, k]
        pad_hi = n + pe  # positions past the explicit end pad come from ceil_mode: never counted
        axes_pos.append((pos, n, pos < pad_hi))
        out_shape.append(out)
    nd = len(in_sizes)
    flat = np.zeros([1] * (2 * nd), np.int64)
    valid = np.ones([1] * (2 * nd), bool)
    in_pad = np.ones([1] * (2 * nd), bool)
    for i, (pos, n, inside_pads) in enumerate(axes_pos):
        shape = [1] * (2 * nd)
        shape[i], shape[nd + i] = pos.shape
        p = pos.reshape(shape)
        flat = flat * n + np.clip(p, 0, n - 1)
        valid = valid & (p >= 0) & (p < n)
        in_pad = in_pad & inside_pads.reshape(shape)
    o, k = int(np.prod(out_shape)), int(np.prod(kernel))
    idx = np.where(valid, flat, -1).reshape(o, k)
    return idx, in_pad.reshape(o, k) if in_pad.shape != () else np.ones((o, k), bool), out_shape


def _setup(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    nd = x.ndim - 2
    kernel = list(kernel_shape)
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    padding = geometry.padding(auto_pad, x.shape[2:], kernel, strides, dilations, pads)
    idx, in_pad, out_shape = _windows(x.shape[2:], kernel, strides, dilations, padding, ceil_mode)
    in_pad = np.broadcast_to(in_pad, idx.shape)
    patches = x.reshape(x.shape[:2] + (-1,))[..., np.maximum(idx, 0)]  # [N, C, O, K]
    return patches, idx, in_pad, out_shape


@handler("MaxPool")
def max_pool(ctx, x, *, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, pads=None,
             storage_order=0, strides=None):
    patches, idx, _, out_shape = _setup(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    lowest = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    patches = jnp.where(idx >= 0, patches, jnp.asarray(lowest, x.dtype))
    y = jnp.max(patches, axis=-1).reshape(x.shape[:2] + tuple(out_shape))
    if ctx.num_outputs < 2:
        return y
    best = jnp.take_along_axis(jnp.asarray(idx)[None, None], jnp.argmax(patches, -1)[..., None], -1)[..., 0]
    spatial = x.shape[2:]
    if storage_order:  # column-major over the spatial dims
        coords = jnp.unravel_index(best, spatial)
        best = jnp.ravel_multi_index(coords[::-1], spatial[::-1], mode="clip")
    n, c = x.shape[:2]
    base = (jnp.arange(n * c) * int(np.prod(spatial))).reshape(n, c, 1)
    return y, (best + base).astype(jnp.int64).reshape(y.shape)


@handler("AveragePool")
def average_pool(ctx, x, *, kernel_shape, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0,
                 dilations=None, pads=None, strides=None):
    patches, idx, in_pad, out_shape = _setup(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    valid = idx >= 0
    patches = jnp.where(valid, patches, jnp.zeros((), x.dtype))
    counted = in_pad if count_include_pad and auto_pad == "NOTSET" else valid
    count = counted.sum(-1).astype(x.dtype)
    y = patches.sum(-1) / jnp.asarray(count)
    return y.astype(x.dtype).reshape(x.shape[:2] + tuple(out_shape))


@handler("LpPool")
def lp_pool(ctx, x, *, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, p=2,
            pads=None, strides=None):
    patches, idx, _, out_shape = _setup(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    patches = jnp.where(idx >= 0, patches, jnp.zeros((), x.dtype))
    y = jnp.sum(jnp.abs(patches) ** p, axis=-1) ** (1.0 / p)
    return y.astype(x.dtype).reshape(x.shape[:2] + tuple(out_shape))


def _spatial(x):
    return tuple(range(2, x.ndim))


@handler("GlobalAveragePool")
def global_average_pool(ctx, x):
    return jnp.mean(x, axis=_spatial(x), keepdims=True)


@handler("GlobalMaxPool")
def global_max_pool(ctx, x):
    return jnp.max(x, axis=_spatial(x), keepdims=True)


@handler("GlobalLpPool", since=2)
def global_lp_pool(ctx, x, *, p=2):
    return (jnp.sum(jnp.abs(x) ** p, axis=_spatial(x), keepdims=True) ** (1.0 / p)).astype(x.dtype)


@handler("MaxUnpool", since=9)
def max_unpool(ctx, x, indices, output_shape=None, *, kernel_shape, pads=None, strides=None):
    nd = x.ndim - 2
    strides = list(strides or [1] * nd)
    pads = list(pads or [0] * (2 * nd))
    out = list(x.shape[:2]) + [(x.shape[2 + i] - 1) * strides[i] - pads[i] - pads[i + nd]
                               + kernel_shape[i] for i in range(nd)]
    flat = jnp.zeros(int(np.prod(out)), x.dtype)
    flat = flat.at[jnp.asarray(indices).reshape(-1)].set(jnp.asarray(x).reshape(-1), mode="drop")
    y = flat.reshape(out)
    if output_shape is not None:  # the indices address the default shape; extra room pads the end
        want = [int(v) for v in ctx.static(output_shape, "output_shape")]
        y = jnp.pad(y, [(0, max(w - o, 0)) for w, o in zip(want, out)])
        y = y[tuple(slice(0, w) for w in want)]
    return y
