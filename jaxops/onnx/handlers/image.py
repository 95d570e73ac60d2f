"""Image resampling: Resize (opsets 10-19), Upsample, GridSample.

Resize is separable: for each resized axis a static [out, in] weight matrix (numpy, built from
the coordinate mapping and the interpolation kernel) is contracted with the input, so the op
is linear in the data, jit/grad friendly and exact for nearest (one-hot rows)."""
from __future__ import annotations

import itertools

import numpy as np
import jax.numpy as jnp

from jaxops._src import geometry

from ..registry import handler
from ._util import norm_axis


def _source_coords(mode, out_n, in_n, scale, roi):
    """Source coordinate of every output index along one axis (float64), and for
    tf_crop_and_resize the mask of positions outside the input."""
    x = geometry.resize_source(mode, np.arange(out_n, dtype=np.float64), scale, in_n,
                               scale * in_n, roi)
    outside = (x < 0) | (x > in_n - 1) if mode == "tf_crop_and_resize" else None
    return x, outside


def _cubic(t, a):
    """Keys cubic kernel weights for taps at offsets -1, 0, 1, 2 from floor(x); t in [0, 1]."""
    def k(d):
        d = abs(d)
        if d <= 1:
            return (a + 2) * d**3 - (a + 3) * d**2 + 1
        if d < 2:
            return a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a
        return 0.0
    return np.array([k(t + 1), k(t), k(1 - t), k(2 - t)])


def _kernel(mode, nearest_mode, a, antialias, scale):
    """ratio -> tap weights (an even count of taps, centred as in the ONNX reference)."""
    if mode == "nearest":
        def f(r):
            if r == 1:  # an exact source position
                return np.array([0.0, 1.0])
            up = {"round_prefer_floor": r > 0.5, "round_prefer_ceil": r >= 0.5,
                  "floor": False, "ceil": True}[nearest_mode]
            return np.array([0.0, 1.0]) if up else np.array([1.0, 0.0])
        return f
    s = min(scale, 1.0)
    if mode == "linear":
        if not antialias:
            return lambda r: np.array([1 - r, r])
        start = int(np.floor(-1 / s) + 1)

        def f(r):
            w = np.clip(1 - np.abs((np.arange(start, 2 - start) - r) * s), 0, 1)
            return w / w.sum()
        return f
    if mode == "cubic":
        if not antialias:
            return lambda r: _cubic(r, a)
        start = int(np.floor(-2 / s) + 1)

        def f(r):
            d = np.abs((np.arange(start, 2 - start) - r) * s)
            w = np.where(d <= 1, (a + 2) * d**3 - (a + 3) * d**2 + 1,
                         np.where(d < 2, a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a, 0.0))
            return w / w.sum()
        return f
    raise ValueError(f"Resize: unknown mode {mode!r}")


def _weights(in_n, out_n, scale, roi, ctm, kernel, exclude_outside):
    x, outside = _source_coords(ctm, out_n, in_n, scale, roi)
    base = np.floor(x)
    exact = x == base
    ratio = np.where(exact, 1.0, x - base)
    coeffs = np.stack([kernel(float(r)) for r in ratio])  # [out, n]
    n = coeffs.shape[1]
    first = np.where(exact, x - n // 2, base - n // 2 + 1).astype(np.int64)
    taps = first[:, None] + np.arange(n)[None, :]
    if exclude_outside:
        coeffs = np.where((taps < 0) | (taps >= in_n), 0.0, coeffs)
        total = coeffs.sum(-1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    w = np.zeros((out_n, in_n))
    np.add.at(w, (np.repeat(np.arange(out_n), n), np.clip(taps, 0, in_n - 1).reshape(-1)),
              coeffs.reshape(-1))
    return w, outside


def resize(x, scales=None, sizes=None, roi=None, axes=None, *, mode="nearest",
           coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75, exclude_outside=0,
           extrapolation_value=0.0, keep_aspect_ratio_policy="stretch",
           nearest_mode="round_prefer_floor", antialias=0, check_size=None):
    """check_size(shape, dtype): refuses sizes over the memory budget (ctx.check_size), called
    with the output's shape and each axis's weights before they are built on the host."""
    r = x.ndim
    axes = list(range(r)) if axes is None else [norm_axis(a, r) for a in axes]
    full_roi = None
    if roi is not None and len(roi):
        k = len(roi) // 2
        full_roi = [(0.0, 1.0)] * r
        for i, a in enumerate(axes if k == len(axes) else range(r)):
            full_roi[a] = (float(roi[i]), float(roi[i + k]))
    scale = [1.0] * r
    out = list(x.shape)
    if sizes is not None:
        for a, s in zip(axes, sizes):
            scale[a] = s / x.shape[a]
            out[a] = int(s)
        if keep_aspect_ratio_policy != "stretch":
            pick = min if keep_aspect_ratio_policy == "not_larger" else max
            common = pick(scale[a] for a in axes)
            for a in axes:
                scale[a] = common
                out[a] = int(common * x.shape[a] + 0.5)
    else:
        for a, s in zip(axes, scales):
            scale[a] = float(s)
            out[a] = int(np.floor(s * x.shape[a]))
    in_dtype = x.dtype
    if check_size is not None:
        check_size(out, in_dtype)
        for a in axes:
            check_size((out[a], x.shape[a]), np.float64)  # the [out, in] weights
    y = x if jnp.issubdtype(in_dtype, jnp.floating) else jnp.asarray(x, jnp.float32)
    for a in axes:
        a_roi = None if full_roi is None else full_roi[a]
        if np.isclose(scale[a], 1.0) and out[a] == x.shape[a] and (a_roi in (None, (0.0, 1.0))):
            continue
        kernel = _kernel(mode, nearest_mode, cubic_coeff_a, antialias, scale[a])
        w, outside = _weights(x.shape[a], out[a], scale[a], a_roi or (0.0, 1.0),
                              coordinate_transformation_mode, kernel, exclude_outside)
        y = jnp.moveaxis(jnp.tensordot(y, jnp.asarray(w, y.dtype), axes=([a], [1])), -1, a)
        if outside is not None and outside.any():
            shape = [1] * r
            shape[a] = out[a]
            y = jnp.where(outside.reshape(shape), jnp.asarray(extrapolation_value, y.dtype), y)
    if not jnp.issubdtype(in_dtype, jnp.floating):
        info = jnp.iinfo(in_dtype)
        y = jnp.clip(jnp.round(y), info.min, info.max)
    return y.astype(in_dtype)


def _floats(ctx, v, what):
    if v is None:
        return None
    a = np.asarray(ctx.static(v, what)).reshape(-1)
    return None if a.size == 0 else a.tolist()


@handler("Resize", since=10)
def resize_10(ctx, x, scales, *, mode="nearest"):
    return resize(x, scales=_floats(ctx, scales, "scales"), mode=mode,
                  coordinate_transformation_mode="asymmetric", nearest_mode="floor",
                  check_size=ctx.check_size)


@handler("Resize", since=11)
def resize_11(ctx, x, roi=None, scales=None, sizes=None, *, axes=None, **attrs):
    return resize(x, _floats(ctx, scales, "scales"), _floats(ctx, sizes, "sizes"),
                  _floats(ctx, roi, "roi"), axes, check_size=ctx.check_size, **attrs)


@handler("Upsample", since=7)
def upsample_7(ctx, x, *, scales, mode="nearest"):
    return resize(x, scales=list(scales), mode=mode, coordinate_transformation_mode="asymmetric",
                  nearest_mode="floor", check_size=ctx.check_size)


@handler("Upsample", since=9)
def upsample_9(ctx, x, scales, *, mode="nearest"):
    return upsample_7(ctx, x, scales=_floats(ctx, scales, "scales"), mode=mode)


def _reflect(v, lo, hi):
    span = hi - lo
    below, above = v < lo, v > hi
    d = jnp.where(below, lo - v, v - hi)
    n = jnp.floor(d / span)
    rem = d - n * span
    even = (n % 2) == 0
    from_below = jnp.where(even, lo + rem, hi - rem)
    from_above = jnp.where(even, hi - rem, lo + rem)
    return jnp.where(below, from_below, jnp.where(above, from_above, v))


def _cubic_taps(t):
    a = -0.75
    t = jnp.abs(t)
    def near(d):
        return ((a + 2) * d - (a + 3)) * d * d + 1
    def far(d):
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


@handler("GridSample", since=16)
def grid_sample(ctx, x, grid, *, align_corners=0, mode="bilinear", padding_mode="zeros"):
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    n, c = x.shape[:2]
    dims = x.shape[2:]
    nd = len(dims)
    g = jnp.asarray(grid).astype(x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32)
    taps_per_dim = []
    for i, size in enumerate(dims):
        v = g[..., nd - 1 - i]  # the grid's last dim lists x (width) first
        v = (v + 1) / 2 * (size - 1) if align_corners else ((v + 1) * size - 1) / 2
        lo, hi = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        if mode == "nearest":
            v = jnp.round(v)
        if padding_mode == "border":
            v = jnp.where((v < lo) | (v > hi), jnp.clip(v, 0, size - 1), v)
        elif padding_mode == "reflection":
            v = _reflect(v, lo, hi)
        if mode == "nearest":
            taps = [(v, jnp.ones_like(v))]
        else:
            base = jnp.floor(v)
            t = v - base
            if mode == "linear":
                taps = [(base, 1 - t), (base + 1, t)]
            else:
                taps = list(zip([base - 1, base, base + 1, base + 2], _cubic_taps(t)))
        fixed = []
        for pos, w in taps:
            if padding_mode == "zeros":
                valid = (pos >= 0) & (pos < size)
                w = jnp.where(valid, w, 0)
                pos = jnp.clip(pos, 0, size - 1)
            elif padding_mode == "border":
                pos = jnp.clip(pos, 0, size - 1)
            else:
                pos = jnp.clip(jnp.trunc(_reflect(pos, lo, hi)), 0, size - 1)
            fixed.append((pos.astype(jnp.int32), w))
        taps_per_dim.append(fixed)
    xt = jnp.moveaxis(x, 1, -1)  # [N, *dims, C]
    batch = jnp.arange(n).reshape((n,) + (1,) * (g.ndim - 2))
    out = 0
    for combo in itertools.product(*taps_per_dim):
        idx = (batch,) + tuple(p for p, _ in combo)
        w = 1
        for _, wi in combo:
            w = w * wi
        out = out + xt[idx] * w[..., None].astype(x.dtype)
    return jnp.moveaxis(jnp.asarray(out).astype(x.dtype), -1, 1)


def _roi_taps(n, size, start, bin_size, grid):
    """Sample positions along one axis -> (low, high, low weight, high weight, inside) per
    [pooled, grid] sample, with the edge rules of ORT's RoiAlign."""
    v = start + np.arange(n)[:, None] * bin_size + (np.arange(grid)[None, :] + 0.5) * bin_size / grid
    inside = (v >= -1.0) & (v <= size)
    v = np.maximum(v, 0)
    low = v.astype(np.int64)
    at_end = low >= size - 1
    low = np.where(at_end, size - 1, low)
    high = np.where(at_end, size - 1, low + 1)
    v = np.where(at_end, low, v)
    frac = v - low
    return low, high, 1 - frac, frac, inside


@handler("RoiAlign", since=16)
def roi_align(ctx, x, rois, batch_indices, *, coordinate_transformation_mode="half_pixel",
              mode="avg", output_height=1, output_width=1, sampling_ratio=0, spatial_scale=1.0):
    """The sampling grid depends on the box sizes, so rois and batch_indices must be static."""
    what = "rois/batch_indices (RoiAlign's sampling grid depends on them)"
    boxes = np.asarray(ctx.static(rois, what), np.float64)
    batch = np.asarray(ctx.static(batch_indices, what)).astype(np.int64)
    h, w = x.shape[2:]
    shift = 0.5 if coordinate_transformation_mode == "half_pixel" else 0.0
    xf = jnp.asarray(x).reshape(x.shape[0], x.shape[1], h * w)
    outs = []
    for r in range(boxes.shape[0]):
        x0, y0, x1, y1 = boxes[r] * spatial_scale - shift
        rh, rw = y1 - y0, x1 - x0
        if not shift:
            rh, rw = max(rh, 1.0), max(rw, 1.0)
        gh = sampling_ratio or int(np.ceil(rh / output_height))
        gw = sampling_ratio or int(np.ceil(rw / output_width))
        ylo, yhi, wyl, wyh, yin = _roi_taps(output_height, h, y0, rh / output_height, gh)
        xlo, xhi, wxl, wxh, xin = _roi_taps(output_width, w, x0, rw / output_width, gw)
        # [oh, gh, ow, gw] per corner
        corners = []
        for yi, wy in ((ylo, wyl), (yhi, wyh)):
            for xi, wx in ((xlo, wxl), (xhi, wxh)):
                idx = yi[:, :, None, None] * w + xi[None, None, :, :]
                wt = wy[:, :, None, None] * wx[None, None, :, :]
                wt = wt * (yin[:, :, None, None] & xin[None, None, :, :])
                corners.append(xf[batch[r]][:, idx] * wt.astype(x.dtype))  # [C, oh, gh, ow, gw]
        if mode == "avg":
            v = sum(corners).sum(axis=(2, 4)) / max(gh * gw, 1)
        else:
            v = jnp.max(jnp.stack(corners), axis=0).max(axis=(2, 4))
        outs.append(v)
    return jnp.stack(outs).astype(x.dtype)


@handler("RoiAlign", since=10)
def roi_align_10(ctx, x, rois, batch_indices, **attrs):
    attrs.setdefault("coordinate_transformation_mode", "output_half_pixel")  # opset 10 default
    return roi_align(ctx, x, rois, batch_indices, **attrs)
