"""MaxPoolGrad and AveragePoolGrad (ONNX domain, ORT-private CPU training kernels, outside the
89-op CUDA registry, but in the graphs ORT's gradient builder makes for MaxPool/AveragePool):
MaxPoolGrad as one XLA scatter-add, AveragePoolGrad as the transpose of a windowed sum."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops._src import geometry
from jaxops.ops import _validate as v

_MAX_POOL_ATTRS = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads",
                   "storage_order", "strides")


def max_pool_grad(dY, Indices, *, x_shape, **maxpool_attrs):
    """ORT MaxPoolGrad (ONNX domain, ORT-private; CPU training kernel, outside the 89-op CUDA
    training registry): the gradient of MaxPool from dY and MaxPool's second output Indices.

    dX = zeros(x_shape) with dX.flat[Indices[i]] += dY[i]: Indices are flat indices into the
    whole X tensor (batch and channel included), as MaxPool writes them for storage_order=0.
    ORT's kernel reads X's shape from the graph's value info; here it is the keyword
    `x_shape`, whose dim 0 is replaced by dY's (as ORT does). MaxPool's attributes, which
    ORT's builder copies onto the node, are accepted and ignored, storage_order included:
    like ORT, indices made with storage_order=1 (column-major within each plane) are applied
    as row-major flat indices. An index outside [0, numel(X)) -- out-of-bounds memory in
    ORT -- is dropped here. Duplicate indices (overlapping windows) accumulate."""
    op = "max_pool_grad"
    unknown = set(maxpool_attrs) - set(_MAX_POOL_ATTRS)
    if unknown:
        v.fail(op, TypeError, f"unexpected attributes {sorted(unknown)}")
    dY, idx = jnp.asarray(dY), jnp.asarray(Indices)
    v.floats(op, dY=dY)
    if idx.dtype not in (jnp.int64, jnp.int32):
        v.fail(op, TypeError, f"Indices must be int64 (or int32), got {idx.dtype}")
    v.same_shape(op, dY=dY, Indices=idx)
    shape = tuple(v.integer(op, "x_shape", i) for i in x_shape)
    if len(shape) != dY.ndim or dY.ndim < 3:
        v.fail(op, ValueError, f"x_shape must have dY's rank {dY.ndim} (>= 3), got {shape}")
    shape = (dY.shape[0],) + shape[1:]
    size = int(np.prod(shape))
    flat = idx.reshape(-1)
    flat = jnp.where((flat < 0) | (flat >= size), size, flat)  # dropped, never wrapped
    acc = v.compute_dtype(dY.dtype)
    dX = jnp.zeros(size, acc).at[flat].add(dY.reshape(-1).astype(acc), mode="drop")
    return dX.astype(dY.dtype).reshape(shape)


def _pool_pads(op, x_shape, dy_shape, kernel, strides, pads, auto_pad, ceil_mode):
    """Per spatial dim (pad_begin, pad_end), with the end pad extended so the windows make
    exactly dY's spatial size (ceil_mode's partial last window)."""
    spatial = x_shape[2:]
    n = len(spatial)
    if auto_pad not in ("NOTSET", "VALID") + geometry.SAME:
        v.fail(op, ValueError, f"unknown auto_pad {auto_pad!r}")
    if auto_pad == "NOTSET" and pads is not None and len(pads) != 2 * n:
        v.fail(op, ValueError, f"pads must hold 2 x {n} values, got {list(pads)}")
    pairs = geometry.padding(auto_pad, spatial, kernel, strides, [1] * n, pads)
    out = []
    for size, k, st, (b, e), got in zip(spatial, kernel, strides, pairs, dy_shape[2:]):
        if geometry.pool_output_size(size, k, st, b, e, ceil_mode) != got:
            v.fail(op, ValueError, f"dY's spatial shape {tuple(dy_shape[2:])} does not match "
                                   f"the pooling of x_shape {tuple(x_shape)}")
        out.append((b, e, max(0, (got - 1) * st + k - (size + b + e))))
    return out


def average_pool_grad(dY, *, x_shape, kernel_shape, strides=None, pads=None, auto_pad="NOTSET",
                      ceil_mode=0, count_include_pad=0, dilations=None):
    """ORT AveragePoolGrad (ONNX domain, ORT-private): the gradient of AveragePool.

    The exact gradient of ORT's AveragePool: each dY element spreads evenly over the input
    positions its window covers, divided by the full window size with count_include_pad=1
    (ORT's forward divides so even where ceil_mode's last window sticks out of the padded
    input) and by the number of input positions it covers otherwise. X's shape comes from
    the graph's value info in ORT; here it is `x_shape`, whose dim 0 is replaced by dY's.

    ORT 1.19.2's CPU AveragePoolGrad kernel disagrees with its own forward in two cases, where
    this follows the forward: 3-D pooling, and auto_pad=SAME_LOWER (its gradient puts the odd
    pad at the end, as for SAME_UPPER)."""
    op = "average_pool_grad"
    dY = jnp.asarray(dY)
    dtype = v.floats(op, dY=dY)
    kernel = tuple(v.integer(op, "kernel_shape", k) for k in kernel_shape)
    shape = tuple(v.integer(op, "x_shape", i) for i in x_shape)
    n = dY.ndim - 2
    if dY.ndim < 3 or len(shape) != dY.ndim or len(kernel) != n:
        v.fail(op, ValueError, f"dY (rank {dY.ndim} >= 3), x_shape {shape} and kernel_shape "
                               f"{kernel} must agree in rank")
    strides = tuple(v.integer(op, "strides", i) for i in (strides or [1] * n))
    if any(d != 1 for d in (dilations or [1] * n)):
        v.fail(op, ValueError, f"dilations other than 1 are not supported, got {dilations}")
    if len(strides) != n or min(kernel + strides) < 1:
        v.fail(op, ValueError, f"kernel_shape {kernel} and strides {strides} must be {n} "
                               "positive values")
    if shape[1] != dY.shape[1]:
        v.fail(op, ValueError, f"x_shape {shape} and dY {dY.shape} differ in channels")
    shape = (dY.shape[0],) + shape[1:]
    pads3 = _pool_pads(op, shape, dY.shape, kernel, strides, pads, auto_pad, ceil_mode)
    acc = v.compute_dtype(dtype)
    window, step = (1, 1) + kernel, (1, 1) + strides
    pad = ((0, 0), (0, 0)) + tuple((b, e + extra) for b, e, extra in pads3)
    if count_include_pad:  # ORT's forward divides every window by its full size
        counts = float(np.prod(kernel))
    else:
        counts = lax.reduce_window(jnp.ones((1, 1) + shape[2:], acc), np.zeros((), acc),
                                   lax.add, window, step, pad)

    def pool(x):
        return lax.reduce_window(x, np.zeros((), acc), lax.add, window, step, pad) / counts

    (dX,) = jax.linear_transpose(pool, jax.ShapeDtypeStruct(shape, acc))(dY.astype(acc))
    return dX.astype(dtype)


__all__ = ["average_pool_grad", "max_pool_grad"]

ORT_OPS = {("", "MaxPoolGrad"): max_pool_grad, ("", "AveragePoolGrad"): average_pool_grad}
