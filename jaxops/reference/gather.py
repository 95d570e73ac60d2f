"""Pure-JAX GatherGrad, GatherElementsGrad, GatherNDGrad and SliceGrad: the test oracle and
the JAXOPS_DISABLE fallback.

Index rules shared by all: a negative index is wrapped once (k + size); an index still
outside [0, size) is dropped (adds nothing), never clamped. Scatter-adds accumulate in f32
(f64 for f64) and round once at the end, as the kernels do. XLA's scatter-add may sum
duplicates in any order (atomics on GPU): these are oracles, not deterministic kernels.
"""
import math

import jax.numpy as jnp
from jax import lax


def acc_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def wrap_or_drop(idx, size):
    """Wrapped indices in [0, size), with `size` (out of range: dropped) for bad ones."""
    idx = jnp.where(idx < 0, idx + size, idx)
    return jnp.where((idx >= 0) & (idx < size), idx, size)


def gather(x, indices, axis=0):
    """take along `axis` with the same rules: wrapped negatives, 0 for a dropped index."""
    idx = wrap_or_drop(indices, x.shape[axis])
    return jnp.take(x, idx, axis=axis, mode="fill", fill_value=0)


def gather_grad(shape, indices, dY, axis=0):
    """dX = zeros(shape); dX[..., indices[p], ...] += dY[..., p, ...] along `axis`."""
    shape = tuple(shape)
    axis = axis % len(shape)
    idx = wrap_or_drop(indices, shape[axis])
    out = jnp.zeros(shape, acc_dtype(dY.dtype))
    where = (slice(None),) * axis + (idx,)
    return out.at[where].add(dY.astype(out.dtype), mode="drop").astype(dY.dtype)


def gather_elements_grad(dY, shape, indices, axis=0):
    """dX = zeros(shape); dX[i with i[axis] = indices[i]] += dY[i] for every position i of dY."""
    shape = tuple(shape)
    axis = axis % len(shape)
    where = [lax.broadcasted_iota(jnp.int64 if indices.dtype == jnp.int64 else jnp.int32,
                                  dY.shape, d) for d in range(dY.ndim)]
    where[axis] = wrap_or_drop(indices, shape[axis])
    out = jnp.zeros(shape, acc_dtype(dY.dtype))
    return out.at[tuple(where)].add(dY.astype(out.dtype), mode="drop").astype(dY.dtype)


def gather_nd_grad(shape, indices, update, batch_dims=0):
    """dX = zeros(shape); the GatherND slice of dX that indices[b..., g...] addresses gets
    update[b..., g...] added (batch dims index dX's first `batch_dims` dims in step)."""
    shape = tuple(shape)
    b, k = batch_dims, indices.shape[-1]
    lead = indices.shape[:-1]
    where = [lax.broadcasted_iota(indices.dtype, lead, d) for d in range(b)]
    where += [wrap_or_drop(indices[..., j], shape[b + j]) for j in range(k)]
    out = jnp.zeros(shape, acc_dtype(update.dtype))
    if not where:  # every (empty) index tuple addresses all of dX
        return (out + jnp.sum(update.astype(out.dtype), axis=tuple(range(len(lead))))
                ).astype(update.dtype)
    return out.at[tuple(where)].add(update.astype(out.dtype), mode="drop").astype(update.dtype)


def slice_ranges(shape, starts, ends, axes=None, steps=None):
    """ONNX Slice-10+ addressing: one (start, stop, step) per dim of `shape`, as Python
    slices take them (starts/ends clamped, negative ones counted from the end)."""
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [int(a) % rank for a in axes]
    steps = [1] * len(starts) if steps is None else [int(s) for s in steps]
    ranges = [(0, n, 1) for n in shape]
    for a, s, e, step in zip(axes, starts, ends, steps):
        n = shape[a]
        s, e = int(s), int(e)
        s = s + n if s < 0 else s
        e = e + n if e < 0 else e
        if step > 0:
            s, e = min(max(s, 0), n), min(max(e, 0), n)
        else:  # backwards: start in [0, n-1], end in [-1, n-1]
            s, e = min(max(s, 0), n - 1), min(max(e, -1), n - 1)
        ranges[a] = (s, e, step)
    return ranges


def slice_count(start, stop, step):
    return max(0, math.ceil((stop - start) / step))


def slice_grad(dY, shape, starts, ends, axes=None, steps=None):
    """dX = zeros(shape); dX[Slice(starts, ends, axes, steps)] = dY."""
    ranges = slice_ranges(tuple(shape), starts, ends, axes, steps)
    where = tuple(slice(s, None if e < 0 else e, st) for s, e, st in ranges)
    return jnp.zeros(tuple(shape), dY.dtype).at[where].set(dY)
