"""MaxPoolGrad as a segment sum over flat indices (out-of-range ids are dropped)."""
import jax
import numpy as np


def max_pool_grad(dY, Indices, x_shape):
    shape = (dY.shape[0],) + tuple(x_shape[1:])
    size = int(np.prod(shape))
    ids = Indices.reshape(-1)
    ids = jax.numpy.where(ids < 0, size, ids)
    return jax.ops.segment_sum(dY.reshape(-1), ids, num_segments=size).reshape(shape)
