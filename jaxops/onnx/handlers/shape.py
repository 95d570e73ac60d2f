"""Shape and indexing ONNX ops: Reshape, Shape, Squeeze, Concat, Split, Slice, Gather*, Scatter*,
Pad, Range, Constant, ... Static (numpy) operands give static results."""
from __future__ import annotations

import numpy as np

from ..registry import handler
from ._util import xp, ints, norm_axis, np_dtype


@handler("Constant")
def constant(ctx, *, value=None, value_float=None, value_floats=None, value_int=None,
             value_ints=None, value_string=None, value_strings=None, sparse_value=None):
    if value is not None:
        return np.asarray(value)
    if value_float is not None:
        return np.asarray(value_float, np.float32)
    if value_floats is not None:
        return np.asarray(value_floats, np.float32)
    if value_int is not None:
        return np.asarray(value_int, np.int64)
    if value_ints is not None:
        return np.asarray(value_ints, np.int64)
    if value_string is not None:
        return np.asarray(value_string, object)
    if value_strings is not None:
        return np.asarray(value_strings, object)
    raise ValueError("Constant: sparse_value is not supported")


@handler("ConstantOfShape", since=9)
def constant_of_shape(ctx, shape, *, value=None):
    shape = ints(ctx, shape, "shape")
    v = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    ctx.check_size(shape, v.dtype)  # numpy would fill it before any check after the node
    return np.full(shape, v[0], v.dtype)


@handler("Shape")
def shape_(ctx, x, *, start=0, end=None):
    s = np.asarray(np.shape(x), np.int64)
    r = len(s)
    start = max(0, min(r, norm_axis(start, r)))
    end = r if end is None else max(0, min(r, norm_axis(end, r)))
    return s[start:end]


@handler("Size")
def size(ctx, x):
    return np.asarray(int(np.prod(np.shape(x))), np.int64)


@handler("Reshape", since=5)
def reshape(ctx, x, shape, *, allowzero=0):
    shape = ints(ctx, shape, "shape")
    if not allowzero:
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return xp(x).reshape(x, shape)


@handler("Flatten")
def flatten(ctx, x, *, axis=1):
    axis = norm_axis(axis, x.ndim)
    lead = int(np.prod(x.shape[:axis]))
    return xp(x).reshape(x, (lead, -1) if lead else (0, int(np.prod(x.shape[axis:]))))


@handler("Squeeze")
def squeeze_1(ctx, x, *, axes=None):
    return _squeeze(x, axes)


@handler("Squeeze", since=13)
def squeeze_13(ctx, x, axes=None):
    return _squeeze(x, ints(ctx, axes, "axes"))


def _squeeze(x, axes):
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    return xp(x).squeeze(x, tuple(norm_axis(a, x.ndim) for a in axes))


@handler("Unsqueeze")
def unsqueeze_1(ctx, x, *, axes):
    return _unsqueeze(x, axes)


@handler("Unsqueeze", since=13)
def unsqueeze_13(ctx, x, axes):
    return _unsqueeze(x, ints(ctx, axes, "axes"))


def _unsqueeze(x, axes):
    rank = np.ndim(x) + len(axes)
    return xp(x).expand_dims(x, tuple(sorted(norm_axis(a, rank) for a in axes)))


@handler("Transpose")
def transpose(ctx, x, *, perm=None):
    return xp(x).transpose(x, perm)


@handler("Expand", since=8)
def expand(ctx, x, shape):
    shape = ints(ctx, shape, "shape")
    out = np.broadcast_shapes(tuple(shape), np.shape(x))
    return xp(x).broadcast_to(x, out)


@handler("Tile", since=6)
def tile(ctx, x, repeats):
    repeats = ints(ctx, repeats, "repeats")
    if len(repeats) == np.ndim(x):
        ctx.check_size([n * r for n, r in zip(np.shape(x), repeats)], x.dtype)
    return xp(x).tile(x, repeats)


@handler("Concat", since=4)
def concat(ctx, *xs, axis):
    xs = [x for x in xs if x is not None]
    return xp(*xs).concatenate(xs, axis=axis)


@handler("Concat")
def concat_1(ctx, *xs, axis=1):
    return concat(ctx, *xs, axis=axis)


def _split(ctx, x, split, axis, num_outputs=None):
    axis = norm_axis(axis, x.ndim)
    n = x.shape[axis]
    if split is None:
        if num_outputs is not None and num_outputs != ctx.num_outputs:
            # the list of parts would be num_outputs long, whatever the node declares
            raise ctx.error(f"num_outputs={num_outputs}, but the node has {ctx.num_outputs} "
                            "outputs")
        k = num_outputs or ctx.num_outputs
        chunk = -(-n // k)
        split = [min(chunk, n - i * chunk) for i in range(k)]
    cuts = np.cumsum(split)[:-1].tolist()
    return tuple(xp(x).split(x, cuts, axis=axis))


@handler("Split", since=2)
def split_2(ctx, x, *, axis=0, split=None):
    return _split(ctx, x, split, axis)


@handler("Split", since=13)
def split_13(ctx, x, split=None, *, axis=0, num_outputs=None):
    return _split(ctx, x, ints(ctx, split, "split"), axis, num_outputs)


def _slice(x, starts, ends, axes, steps):
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    idx = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = norm_axis(a, x.ndim)
        n = x.shape[a]
        s = s + n if s < 0 else s
        e = e + n if e < 0 else e
        if st > 0:
            s, e = min(max(s, 0), n), min(max(e, 0), n)
        else:
            s, e = min(max(s, -1), n - 1), min(max(e, -1), n - 1)
        idx[a] = slice(s, None if e < 0 else e, st)
    return x[tuple(idx)]


@handler("Slice")
def slice_1(ctx, x, *, starts, ends, axes=None):
    return _slice(x, starts, ends, axes, None)


@handler("Slice", since=10)
def slice_10(ctx, x, starts, ends, axes=None, steps=None):
    return _slice(x, ints(ctx, starts, "starts"), ints(ctx, ends, "ends"),
                  ints(ctx, axes, "axes"), ints(ctx, steps, "steps"))


def _wrap(m, idx, n):
    return m.where(idx < 0, idx + n, idx)


@handler("Gather")
def gather(ctx, x, indices, *, axis=0):
    m = xp(x, indices)
    axis = norm_axis(axis, np.ndim(x))
    return m.take(x, _wrap(m, indices, x.shape[axis]), axis=axis)


@handler("GatherElements", since=11)
def gather_elements(ctx, x, indices, *, axis=0):
    m = xp(x, indices)
    axis = norm_axis(axis, x.ndim)
    return m.take_along_axis(x, _wrap(m, indices, x.shape[axis]), axis=axis)


def _nd_index(m, x, indices, batch_dims):
    """Index tuple for GatherND/ScatterND: batch dims aligned, the last index dim addressing x."""
    k = indices.shape[-1]
    idx = _wrap(m, indices, np.asarray(x.shape[batch_dims:batch_dims + k]))
    batch = indices.shape[:batch_dims]
    lead = []
    for b in range(batch_dims):
        shape = [1] * (indices.ndim - 1)
        shape[b] = batch[b]
        lead.append(m.arange(batch[b]).reshape(shape))
    return tuple(lead) + tuple(idx[..., j] for j in range(k))


@handler("GatherND", since=11)
def gather_nd(ctx, x, indices, *, batch_dims=0):
    m = xp(x, indices)
    return x[_nd_index(m, x, indices, batch_dims)]


def _scatter(x, index, updates, reduction):
    if isinstance(x, np.ndarray):
        out = x.copy()
        op = {"none": None, "add": np.add, "mul": np.multiply,
              "max": np.maximum, "min": np.minimum}[reduction]
        if op is None:
            out[index] = updates
        else:
            op.at(out, index, updates)
        return out
    at = x.at[index]
    return {"none": at.set, "add": at.add, "mul": at.multiply,
            "max": at.max, "min": at.min}[reduction](updates)


def _elements_index(m, indices, axis, n):
    idx = list(m.indices(indices.shape, sparse=True))
    idx[axis] = _wrap(m, indices, n)
    return tuple(idx)


@handler("ScatterElements", since=11)
def scatter_elements(ctx, x, indices, updates, *, axis=0, reduction="none"):
    m = xp(x, indices, updates)
    axis = norm_axis(axis, x.ndim)
    return _scatter(x, _elements_index(m, indices, axis, x.shape[axis]), updates, reduction)


@handler("Scatter", since=9)
def scatter(ctx, x, indices, updates, *, axis=0):
    return scatter_elements(ctx, x, indices, updates, axis=axis)


@handler("ScatterND", since=11)
def scatter_nd(ctx, x, indices, updates, *, reduction="none"):
    m = xp(x, indices, updates)
    return _scatter(x, _nd_index(m, x, indices, 0), updates, reduction)


def _pad(ctx, x, pads, mode, value, axes=None):
    rank = x.ndim
    axes = list(range(rank)) if axes is None else [norm_axis(a, rank) for a in axes]
    k = len(axes)
    width = [(0, 0)] * rank
    for i, a in enumerate(axes):
        width[a] = (pads[i], pads[i + k])
    ctx.check_size([n + lo + hi for n, (lo, hi) in zip(x.shape, width)], x.dtype)
    m = xp(x, value)
    # negative pads crop
    crop = tuple(slice(max(-lo, 0), x.shape[d] - max(-hi, 0)) for d, (lo, hi) in enumerate(width))
    x = x[crop]
    width = [(max(lo, 0), max(hi, 0)) for lo, hi in width]
    if mode == "constant":
        cv = 0 if value is None else value
        return m.pad(x, width, mode="constant", constant_values=m.asarray(cv, x.dtype))
    return m.pad(x, width, mode={"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode])


@handler("Pad", since=2)
def pad_2(ctx, x, *, pads, mode="constant", value=0.0):
    return _pad(ctx, x, pads, mode, np.asarray(value, x.dtype))


@handler("Pad", since=11)
def pad_11(ctx, x, pads, constant_value=None, axes=None, *, mode="constant"):
    cv = None if constant_value is None else constant_value.reshape(())
    return _pad(ctx, x, ints(ctx, pads, "pads"), mode, cv, ints(ctx, axes, "axes"))


@handler("Range", since=11)
def range_(ctx, start, limit, delta):
    s, l, d = (ctx.static(v, "range bound").reshape(()) for v in (start, limit, delta))
    n = max(int(np.ceil((l - s) / d)), 0)
    ctx.check_size((n,), np.asarray(start).dtype)
    return (s + np.arange(n) * d).astype(np.asarray(start).dtype)


@handler("EyeLike", since=9)
def eye_like(ctx, x, *, dtype=None, k=0):
    dt = x.dtype if dtype is None else np_dtype(dtype)
    return np.eye(x.shape[0], x.shape[1], k=k, dtype=dt)


@handler("Trilu", since=14)
def trilu(ctx, x, k=None, *, upper=1):
    k = 0 if k is None else int(ctx.static(k, "k"))
    m = xp(x)
    return m.triu(x, k) if upper else m.tril(x, k)


@handler("DepthToSpace", since=1)
def depth_to_space(ctx, x, *, blocksize, mode="DCR"):
    n, c, h, w = x.shape
    b = blocksize
    m = xp(x)
    if mode == "DCR":
        y = m.reshape(x, (n, b, b, c // b**2, h, w)).transpose(0, 3, 4, 1, 5, 2)
    else:
        y = m.reshape(x, (n, c // b**2, b, b, h, w)).transpose(0, 1, 4, 2, 5, 3)
    return m.reshape(y, (n, c // b**2, h * b, w * b))


@handler("SpaceToDepth", since=1)
def space_to_depth(ctx, x, *, blocksize, mode="DCR"):
    n, c, h, w = x.shape
    b = blocksize
    m = xp(x)
    y = m.reshape(x, (n, c, h // b, b, w // b, b))
    y = y.transpose(0, 3, 5, 1, 2, 4) if mode == "DCR" else y.transpose(0, 1, 3, 5, 2, 4)
    return m.reshape(y, (n, c * b * b, h // b, w // b))


@handler("ReverseSequence", since=10)
def reverse_sequence(ctx, x, lengths, *, batch_axis=1, time_axis=0):
    m = xp(x, lengths)
    t = x.shape[time_axis]
    shape = [1] * x.ndim
    shape[time_axis] = t
    pos = m.arange(t).reshape(shape)
    lshape = [1] * x.ndim
    lshape[batch_axis] = x.shape[batch_axis]
    L = m.reshape(lengths, lshape)
    src = m.where(pos < L, L - 1 - pos, pos)
    src = m.broadcast_to(src, x.shape)
    return m.take_along_axis(x, src, axis=time_axis)


@handler("Compress", since=9)
def compress(ctx, x, condition, *, axis=None):
    cond = ctx.static(condition, "condition (Compress output shape depends on it)")
    if axis is None:
        return xp(x).reshape(x, -1)[np.nonzero(cond)[0]]
    idx = np.nonzero(cond)[0]
    return xp(x).take(x, idx, axis=axis)


@handler("NonZero", since=9)
def nonzero(ctx, x):
    v = ctx.static(x, "input (NonZero output shape depends on its values)")
    return np.asarray(np.nonzero(v), np.int64)


@handler("CenterCropPad", since=18)
def center_crop_pad(ctx, x, shape, *, axes=None):
    shape = ints(ctx, shape, "shape")
    axes = list(range(x.ndim)) if axes is None else [norm_axis(a, x.ndim) for a in axes]
    out = list(x.shape)
    for a, s in zip(axes, shape):
        out[a] = s
    ctx.check_size(out, x.dtype)
    m = xp(x)
    for a, s in zip(axes, shape):
        n = x.shape[a]
        if s < n:
            lo = (n - s) // 2
            x = m.take(x, np.arange(lo, lo + s), axis=a)
        elif s > n:
            lo = (s - n) // 2
            width = [(0, 0)] * x.ndim
            width[a] = (lo, s - n - lo)
            x = m.pad(x, width)
    return x
