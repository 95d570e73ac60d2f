"""Reductions: Reduce* (axes as attribute before opset 13/18, as input after), ArgMax/ArgMin."""
from __future__ import annotations

import numpy as np

from ..registry import handler
from ._util import xp, ints, is_float, norm_axis


def _lowest(dtype):
    return -np.inf if is_float(dtype) else np.iinfo(dtype).min


def _highest(dtype):
    return np.inf if is_float(dtype) else np.iinfo(dtype).max


def _logsumexp(m, x, axis, keepdims):
    if x.size == 0:
        return m.log(m.sum(m.exp(x), axis=axis, keepdims=keepdims))
    mx = m.max(x, axis=axis, keepdims=True)
    mx = m.where(m.isfinite(mx), mx, 0)
    out = m.log(m.sum(m.exp(x - mx), axis=axis, keepdims=True)) + mx
    return out if keepdims else m.squeeze(out, axis)


_REDUCERS = {
    "ReduceSum": lambda m, x, a, k: m.sum(x, axis=a, keepdims=k),
    "ReduceMean": lambda m, x, a, k: m.mean(x, axis=a, keepdims=k),
    "ReduceMax": lambda m, x, a, k: m.max(x, axis=a, keepdims=k, initial=_lowest(x.dtype))
    if x.dtype != np.bool_ else m.any(x, axis=a, keepdims=k),
    "ReduceMin": lambda m, x, a, k: m.min(x, axis=a, keepdims=k, initial=_highest(x.dtype))
    if x.dtype != np.bool_ else m.all(x, axis=a, keepdims=k),
    "ReduceProd": lambda m, x, a, k: m.prod(x, axis=a, keepdims=k),
    "ReduceL1": lambda m, x, a, k: m.sum(m.abs(x), axis=a, keepdims=k),
    "ReduceL2": lambda m, x, a, k: m.sqrt(m.sum(x * x, axis=a, keepdims=k)),
    "ReduceSumSquare": lambda m, x, a, k: m.sum(x * x, axis=a, keepdims=k),
    "ReduceLogSum": lambda m, x, a, k: m.log(m.sum(x, axis=a, keepdims=k)),
    "ReduceLogSumExp": lambda m, x, a, k: _logsumexp(m, x, a, k),
}


def _reduce(name, x, axes, keepdims, noop_with_empty_axes=0):
    if not axes:
        if noop_with_empty_axes:
            return x
        axes = None
    m = xp(x)
    axis = None if axes is None else tuple(sorted(norm_axis(a, x.ndim) for a in axes))
    out = _REDUCERS[name](m, x, axis, bool(keepdims))
    return m.asarray(out).astype(x.dtype)


def _register(name, input_since):
    @handler(name, since=1)
    def with_attr(ctx, x, *, axes=None, keepdims=1):
        return _reduce(name, x, axes, keepdims)

    @handler(name, since=input_since)
    def with_input(ctx, x, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        return _reduce(name, x, ints(ctx, axes, "axes"), keepdims, noop_with_empty_axes)


for _name in _REDUCERS:
    _register(_name, 13 if _name == "ReduceSum" else 18)


def _arg(x, axis, keepdims, select_last_index, fn):
    m = xp(x)
    axis = norm_axis(axis, x.ndim)
    if select_last_index:
        n = x.shape[axis]
        out = n - 1 - fn(m.flip(x, axis), axis=axis)
    else:
        out = fn(x, axis=axis)
    out = m.asarray(out).astype(np.int64)
    return m.expand_dims(out, axis) if keepdims else out


@handler("ArgMax")
def argmax(ctx, x, *, axis=0, keepdims=1, select_last_index=0):
    return _arg(x, axis, keepdims, select_last_index, xp(x).argmax)


@handler("ArgMin")
def argmin(ctx, x, *, axis=0, keepdims=1, select_last_index=0):
    return _arg(x, axis, keepdims, select_last_index, xp(x).argmin)
