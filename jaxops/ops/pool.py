"""MaxPoolGrad (ONNX domain, ORT-private): the gradient of MaxPool as one XLA scatter-add."""
import jax.numpy as jnp
import numpy as np

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


__all__ = ["max_pool_grad"]

ORT_OPS = {("", "MaxPoolGrad"): max_pool_grad}
