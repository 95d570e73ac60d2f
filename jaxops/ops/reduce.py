"""ReduceSumTraining (com.microsoft): ReduceSum-13 with the axes as an input.

XLA code (jaxops.reference.reduce): XLA's reductions are close to bandwidth for the sums
this op sees (DivGrad's broadcast reductions), they fuse with the producer, and ORT 1.19.2's
gradient builders emit ONNX ReduceSum instead, so a kernel would rarely run.
"""
import operator

import jax.numpy as jnp
import numpy as np

from jaxops.ops._args import named, static_ints, static_inputs
from jaxops.reference import reduce as ref

_DTYPES = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64,
                                      jnp.int32, jnp.int64))


@static_inputs('axes')
def reduce_sum_training(data, axes, keepdims=1, noop_with_empty_axes=0):
    """ORT ReduceSumTraining: sum of `data` over `axes` (static ints, negative allowed).

    Empty axes (or None) reduce over every dim, or return data unchanged when
    noop_with_empty_axes=1. keepdims=1 keeps reduced dims as 1. float16/bfloat16 accumulate
    in f32; int32/int64 sum in their own dtype (wrapping on overflow, as ORT's kernels).
    """
    data = jnp.asarray(data)
    with named("reduce_sum_training"):
        if np.dtype(data.dtype) not in _DTYPES:
            raise TypeError(f"data must be float16, bfloat16, float32, float64, int32 or int64, "
                            f"got {data.dtype}")
        axes = static_ints([] if axes is None else axes, "axes")
        for a in axes:
            if not -data.ndim <= a < data.ndim:
                raise ValueError(f"axis {a} is out of range for rank {data.ndim}")
        axes = tuple(a % data.ndim for a in axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes must not repeat a dim, got {axes}")
        keepdims = operator.index(keepdims)
        noop_with_empty_axes = operator.index(noop_with_empty_axes)
    return ref.reduce_sum_training(data, axes, keepdims, noop_with_empty_axes)


__all__ = ["reduce_sum_training"]

ORT_OPS = {("com.microsoft", "ReduceSumTraining"): reduce_sum_training}
