"""Assorted ONNX ops: CumSum/CumProd, TopK, OneHot, Unique, NonMaxSuppression, BitCast,
TensorScatter. Unique and NonMaxSuppression have data-dependent output shapes: they need
static (constant) inputs."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jax import lax

from ..registry import handler
from ._util import xp, norm_axis, np_dtype, is_static


def _cum(x, axis, exclusive, reverse, op, identity):
    m = xp(x)
    if reverse:
        x = m.flip(x, axis)
    out = op(x, axis=axis)
    if exclusive:
        out = m.concatenate([m.full_like(m.take(out, np.arange(1), axis=axis), identity),
                             m.take(out, np.arange(x.shape[axis] - 1), axis=axis)], axis=axis)
    out = out.astype(x.dtype)
    return m.flip(out, axis) if reverse else out


@handler("CumSum", since=11)
def cumsum(ctx, x, axis, *, exclusive=0, reverse=0):
    a = norm_axis(int(ctx.static(axis, "axis")), x.ndim)
    return _cum(x, a, exclusive, reverse, xp(x).cumsum, 0)


@handler("CumProd", since=26)
def cumprod(ctx, x, axis, *, exclusive=0, reverse=0):
    a = norm_axis(int(ctx.static(axis, "axis")), x.ndim)
    return _cum(x, a, exclusive, reverse, xp(x).cumprod, 1)


def _topk(x, k, axis, largest, sorted_):
    axis = norm_axis(axis, x.ndim)
    xt = jnp.moveaxis(x, axis, -1)
    if largest:
        key = xt
    elif jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        key = jnp.iinfo(x.dtype).max - xt
    else:
        key = -xt
    _, idx = lax.top_k(key, k)  # ties keep the lower index first
    vals = jnp.take_along_axis(xt, idx, axis=-1)
    return jnp.moveaxis(vals, -1, axis), jnp.moveaxis(idx.astype(jnp.int64), -1, axis)


@handler("TopK")
def topk_1(ctx, x, *, k, axis=-1):
    return _topk(x, k, axis, 1, 1)


@handler("TopK", since=10)
def topk_10(ctx, x, k, *, axis=-1, largest=1, sorted=1):
    k = int(np.asarray(ctx.static(k, "k")).reshape(()))
    if not 0 <= k <= x.shape[norm_axis(axis, x.ndim)]:
        raise ctx.error(f"k={k} is outside [0, {x.shape[norm_axis(axis, x.ndim)]}] (the axis)")
    return _topk(x, k, axis, largest, sorted)


@handler("OneHot", since=9)
def one_hot(ctx, indices, depth, values, *, axis=-1):
    d = int(np.asarray(ctx.static(depth, "depth")).reshape(-1)[0])
    shape = list(np.shape(indices))
    shape.insert(norm_axis(axis, len(shape) + 1), d)
    # before jnp.arange(d): on the host (x64) a huge depth crashed the process (SIGFPE)
    ctx.check_size(shape, np.asarray(values).dtype)
    idx = jnp.asarray(indices)
    idx = jnp.where(idx < 0, idx + d, idx).astype(jnp.int64)
    rank = idx.ndim + 1
    axis = norm_axis(axis, rank)
    shape = [1] * rank
    shape[axis] = d
    hot = jnp.expand_dims(idx, axis) == jnp.arange(d).reshape(shape)
    return jnp.where(hot, values[1], values[0])


@handler("Unique", since=11)
def unique(ctx, x, *, axis=None, sorted=1):
    v = np.asarray(ctx.static(x, "input (Unique's output shape depends on its values)"))
    y, idx, inv, counts = np.unique(v, return_index=True, return_inverse=True,
                                    return_counts=True, axis=axis)
    if not sorted:  # first-occurrence order
        order = np.argsort(idx, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        y = np.take(y, order, axis=0 if axis is None else axis)
        idx, counts, inv = idx[order], counts[order], rank[inv.reshape(-1)]
    i64 = lambda a: np.asarray(a, np.int64).reshape(-1)
    return (y, i64(idx), i64(inv), i64(counts))[: ctx.num_outputs]


def _iou(a, b, center):
    if center:
        a = np.concatenate([a[:2] - a[2:] / 2, a[:2] + a[2:] / 2])
        b = np.concatenate([b[:2] - b[2:] / 2, b[:2] + b[2:] / 2])
    ay0, ay1 = sorted(a[[0, 2]])
    ax0, ax1 = sorted(a[[1, 3]])
    by0, by1 = sorted(b[[0, 2]])
    bx0, bx1 = sorted(b[[1, 3]])
    inter = max(0.0, min(ay1, by1) - max(ay0, by0)) * max(0.0, min(ax1, bx1) - max(ax0, bx0))
    union = (ay1 - ay0) * (ax1 - ax0) + (by1 - by0) * (bx1 - bx0) - inter
    return inter / union if union > 0 else 0.0


@handler("NonMaxSuppression", since=10)
def non_max_suppression(ctx, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                        score_threshold=None, *, center_point_box=0):
    what = "inputs (NonMaxSuppression's output shape depends on their values)"
    boxes, scores = ctx.static(boxes, what), ctx.static(scores, what)
    limit = 0 if max_output_boxes_per_class is None else int(np.asarray(ctx.static(max_output_boxes_per_class, what)).reshape(-1)[0])
    iou_t = 0.0 if iou_threshold is None else float(np.asarray(ctx.static(iou_threshold, what)).reshape(-1)[0])
    score_t = None if score_threshold is None else float(np.asarray(ctx.static(score_threshold, what)).reshape(-1)[0])
    picked = []
    for b in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[b, c]
            order = [i for i in np.argsort(-s, kind="stable") if score_t is None or s[i] > score_t]
            keep = []
            for i in order:
                if len(keep) >= limit:
                    break
                if all(_iou(boxes[b, i], boxes[b, j], center_point_box) <= iou_t for j in keep):
                    keep.append(i)
            picked += [(b, c, i) for i in keep]
    return np.asarray(picked, np.int64).reshape(-1, 3)


@handler("BitCast", since=26)
def bitcast(ctx, x, *, to):
    to = np_dtype(to)
    if is_static(x):
        return np.asarray(x).view(to)
    if x.dtype == jnp.bool_ or to == np.bool_:  # XLA will not bitcast bool: it is one byte 0/1
        return x.astype(to)
    return lax.bitcast_convert_type(x, to)


@handler("TensorScatter", since=24)
def tensor_scatter(ctx, past_cache, update, write_indices=None, *, mode="linear", axis=-2):
    axis = norm_axis(axis, past_cache.ndim)
    b = past_cache.shape[0]
    n, s = past_cache.shape[axis], update.shape[axis]
    start = jnp.zeros((b,), jnp.int64) if write_indices is None else jnp.asarray(write_indices)
    pos = start[:, None] + jnp.arange(s)[None, :]  # [B, s]
    if mode == "circular":
        pos = pos % n
    shape = [1] * past_cache.ndim
    shape[0], shape[axis] = b, s
    idx = list(jnp.indices(update.shape, sparse=True))
    idx[axis] = pos.reshape(shape)
    return jnp.asarray(past_cache).at[tuple(idx)].set(update, mode="drop")
