"""Pooling: MaxPool (with Indices), AveragePool, LpPool, Global*Pool, MaxUnpool.

Windows are gathered through a static index table (numpy), which handles padding, dilation
and ceil_mode the same way for every pool and stays differentiable. On the CPU, MaxPool
(with or without Indices) and AveragePool of at most _MAX_TAPS taps reduce one strided slice
a kernel tap instead (_sliced, _max_pool_with_indices), which XLA:CPU runs faster than the
gathered [N, C, out, taps] patches, and a 2-D MaxPool without Indices in a graph without
ConvGrad is the CPU kernel (ops.pool_cpu); other platforms keep the gather (the slices were
not measured there)."""
from __future__ import annotations

import functools

import numpy as np
import jax.numpy as jnp
from jax import lax

from jaxops._src import geometry, taps
from jaxops._src.derivatives import with_derivatives_of
from jaxops.ops import pool_cpu
from jaxops.ops.conv import _materialized

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


# Above this many taps a window stays the gather (one slice a tap: a global-size window would
# emit hundreds of slices; the corpus's pools have 9).
_MAX_TAPS = 64

def _geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    """(kernel, strides, dilations, idx, in_pad, out, pad_cfg): _windows' tables and the
    lax.pad config that makes every tap's strided slice of x in bounds."""
    nd = x.ndim - 2
    kernel = list(kernel_shape)
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    padding = geometry.padding(auto_pad, x.shape[2:], kernel, strides, dilations, pads)
    idx, in_pad, out = _windows(x.shape[2:], kernel, strides, dilations, padding, ceil_mode)
    pad_cfg = [(0, 0, 0)]
    for n, k, s, d, (lo, _), o in zip(x.shape[2:], kernel, strides, dilations, padding, out):
        pad_cfg.append((lo, (o - 1) * s + (k - 1) * d + 1 - n - lo, 0))  # a negative end crops
    return kernel, strides, dilations, idx, in_pad, out, pad_cfg + [(0, 0, 0)]


def _tap_slices(x, fill, kernel, strides, dilations, out, pad_cfg, channels_last=True):
    """taps.tap_slices of the NCHW x: [N, *out, C] (channels_last) or [N, C, *out] a tap."""
    nd = x.ndim - 2
    if channels_last:
        x = jnp.transpose(x, (0, *range(2, nd + 2), 1))
    begin_pads = [c[0] for c in pad_cfg[1:1 + nd]]
    return taps.tap_slices(x, fill, kernel, strides, dilations, out, begin_pads,
                           1 if channels_last else 2)


def _channels_first(y):
    return jnp.transpose(y, (0, y.ndim - 1, *range(1, y.ndim - 1)))


def _sliced(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, fill, combine,
            max_kernel=False):
    """(the pool's reduction `combine` over one strided slice a kernel tap [N, C, *out],
    idx, in_pad, out) as _setup's, or None past _MAX_TAPS taps. x is padded with `fill`
    (padding and ceil_mode's overhang: the value that leaves the reduction as it is).

    max_kernel (a max pool in a graph without ConvGrad, whose convolutions run channels last):
    on the CPU the max pool kernel (ops.pool_cpu) where it applies, with the slices'
    derivatives. DeepLabV3's forward (a 3x3 stride-2 pool of [2, 16, 16, 64] after its stem,
    one core, 2026-12-02): the pool 6.7 -> 5.2 us in XLA's trace, and the copy XLA made of its
    output for the next 1x1 convolution gone; the forward 0.94-1.00x the time (in-process A/B).

    The slices are taken channels last and the result is materialized there
    (lax.optimization_barrier) before it goes back to NCHW: XLA:CPU keeps the convolutions'
    activations channels last, and without the barrier it recomputed the pool inside each of
    the next convolution's nine tap slices. Against the gather (one core, interleaved,
    2026-11-24, tools/pool_ab.py): DeepLabV3's jitted forwards 0.91-0.96x the time, ResNet's
    eval program 0.94x; NCHW slices with the barrier 1.04x (ResNet), without it 1.55x
    (DeepLabV3)."""
    if int(np.prod(kernel_shape)) > _MAX_TAPS:
        return None
    kernel, strides, dilations, idx, in_pad, out, pad_cfg = _geometry(
        x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)

    def sliced(x):
        slices = _tap_slices(x, fill, kernel, strides, dilations, out, pad_cfg)
        return _channels_first(_materialized(functools.reduce(combine, slices)))

    def gathered(x):  # other platforms: the gather (the slices were measured on the CPU only)
        patches = _patches(x, idx)
        patches = jnp.where(idx >= 0, patches, jnp.asarray(fill, x.dtype))
        reduce = jnp.max if combine is jnp.maximum else jnp.sum
        return reduce(patches, axis=-1).reshape(x.shape[:2] + tuple(out))

    cpu = sliced
    padding = [(lo, hi) for lo, hi, _ in pad_cfg[1:-1]]  # ceil_mode's overhang in hi
    if max_kernel and pool_cpu.applies(x, kernel, strides, dilations, padding):
        cpu = with_derivatives_of(sliced, lambda x: pool_cpu.max_pool_nchw(
            x, kernel, strides, dilations, padding))
    y = lax.platform_dependent(x, cpu=cpu, default=gathered)
    return y, idx, np.broadcast_to(in_pad, idx.shape), out


def _argmax_table(idx, spatial, storage_order):
    """The flat spatial index each window tap reads [outputs, taps] as MaxPool's Indices
    number it (storage_order 1: column-major), padding -1; except that a window whose first
    tap is padding names its first real tap there. Both forms take the first tap that
    reaches the max and padding holds the lowest value, so a window whose real values are
    all that lowest value picks its first tap: this makes that the first real one (ORT 1.19
    answers c*H*W - W - 1 there, an element of the previous channel)."""
    table = idx.copy()
    if storage_order:
        real = table >= 0
        coords = np.unravel_index(table[real], spatial)
        table[real] = np.ravel_multi_index(coords[::-1], spatial[::-1])
    first_real = np.argmax(table >= 0, axis=1)
    table[:, 0] = table[np.arange(len(table)), first_real]
    return table


def _max_pool_with_indices(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode,
                           storage_order, lowest):
    """(Y, Indices) of MaxPool. On the CPU (<= _MAX_TAPS taps) a running max over one strided
    NCHW slice a tap and the index its winning tap reads, the taps taken last to first and a
    tap winning on >= or as a NaN: the first tap in window order that reaches the max (or the
    first NaN) wins, as argmax over the gathered window does on other platforms. NaN propagates
    to Y, as jnp.max does and ORT's MaxPool without Indices sometimes does (ORT 1.19's kernel
    with Indices skips NaN).

    Slices NCHW and (Y, Indices) materialized: the training graphs' convolutions are NCHW.
    ResNet's train step (tools/pool_ab.py --train, one core, 2026-11-24) against the gather:
    0.96-0.97x the time; taps first to last on > with a NaN check on both sides 0.99x;
    channels-last slices (as _sliced) 1.02-1.03x; NCHW without the barrier 1.27x (the pool
    recomputed in its consumers)."""
    kernel, strides, dilations, idx, _, out, pad_cfg = _geometry(
        x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    spatial = x.shape[2:]
    table = _argmax_table(idx, spatial, storage_order)
    # the spatial index fits int32 (one image's elements); the batch/channel base goes in int64
    index_type = np.int32 if int(np.prod(spatial)) < 2**31 else np.int64
    floating = jnp.issubdtype(x.dtype, jnp.floating)

    def sliced(x):
        slices = _tap_slices(x, lowest, kernel, strides, dilations, out, pad_cfg, channels_last=False)
        y = i = None
        for t, w in reversed(list(enumerate(slices))):  # the last tap first: see the docstring
            tap = jnp.asarray(table[:, t].astype(index_type).reshape(1, 1, *out))
            if y is None:
                y, i = w, jnp.broadcast_to(tap, w.shape)
                continue
            take = w >= y
            if floating:
                take = take | (w != w)  # NaN
            y, i = jnp.where(take, w, y), jnp.where(take, tap, i)
        return _materialized((y, i))

    def gathered(x):  # other platforms: the gather (the slices were measured on the CPU only)
        patches = _patches(x, idx)
        patches = jnp.where(idx >= 0, patches, jnp.asarray(lowest, x.dtype))
        shape = x.shape[:2] + tuple(out)
        best = jnp.take_along_axis(jnp.asarray(table.astype(index_type))[None, None],
                                   jnp.argmax(patches, -1)[..., None], -1)
        return jnp.max(patches, axis=-1).reshape(shape), best.reshape(shape)

    if int(np.prod(kernel)) > _MAX_TAPS:
        y, best = gathered(x)
    else:
        y, best = lax.platform_dependent(x, cpu=sliced, default=gathered)
    n, c = x.shape[:2]
    base = (np.arange(n * c, dtype=np.int64) * int(np.prod(spatial))).reshape(n, c, *[1] * len(out))
    return y, best.astype(jnp.int64) + base


def _patches(x, idx):
    """[N, C, outputs, taps]: each output's window of x (padding taps read element 0: mask them
    with idx >= 0)."""
    return x.reshape(x.shape[:2] + (-1,))[..., np.maximum(idx, 0)]


def _setup(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    *_, idx, in_pad, out_shape, _ = _geometry(x, kernel_shape, strides, dilations, pads,
                                              auto_pad, ceil_mode)
    return _patches(x, idx), idx, np.broadcast_to(in_pad, idx.shape), out_shape


@handler("MaxPool")
def max_pool(ctx, x, *, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, pads=None,
             storage_order=0, strides=None):
    lowest = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    if ctx.num_outputs >= 2:
        return _max_pool_with_indices(x, kernel_shape, strides, dilations, pads, auto_pad,
                                      ceil_mode, storage_order, lowest)
    sliced = _sliced(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, lowest,
                     jnp.maximum, max_kernel=jnp.issubdtype(x.dtype, jnp.floating)
                     and not ctx.graph_has("ConvGrad"))
    if sliced is not None:
        return sliced[0]
    patches, idx, _, out_shape = _setup(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    patches = jnp.where(idx >= 0, patches, jnp.asarray(lowest, x.dtype))
    return jnp.max(patches, axis=-1).reshape(x.shape[:2] + tuple(out_shape))


@handler("AveragePool")
def average_pool(ctx, x, *, kernel_shape, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0,
                 dilations=None, pads=None, strides=None):
    sliced = _sliced(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, 0, jnp.add)
    if sliced is not None:
        total, idx, in_pad, out_shape = sliced
    else:
        patches, idx, in_pad, out_shape = _setup(x, kernel_shape, strides, dilations, pads,
                                                 auto_pad, ceil_mode)
        total = jnp.where(idx >= 0, patches, jnp.zeros((), x.dtype)).sum(-1)
    # count_include_pad counts SAME_* padding too (as ORT and ONNX's reference do)
    counted = in_pad if count_include_pad else idx >= 0
    count = counted.sum(-1).astype(x.dtype).reshape(out_shape)
    y = total.reshape(x.shape[:2] + tuple(out_shape)) / jnp.asarray(count)
    return y.astype(x.dtype)


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
