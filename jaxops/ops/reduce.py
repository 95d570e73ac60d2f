"""ReduceSumTraining (com.microsoft): ReduceSum-13 with the axes as an input.

XLA code (jaxops.reference.reduce): XLA's reductions are close to bandwidth for the sums
this op sees (DivGrad's broadcast reductions), they fuse with the producer, and ORT 1.19.2's
gradient builders emit ONNX ReduceSum instead, so a kernel would rarely run.
"""
import jax.numpy as jnp
import numpy as np

from jaxops._src import rules
from jaxops._src.spec import Matrix, define
from jaxops.reference import reduce as ref

_DTYPES = (*rules.FLOATS, np.dtype(np.int32), np.dtype(np.int64))


def _check(data, axes, *, keepdims, noop_with_empty_axes):
    if np.dtype(data.dtype) not in _DTYPES:
        raise TypeError(f"data must be {rules.FLOAT_WORDS}, int32 or int64, got {data.dtype}")
    dims = [rules.axis(a, data.ndim, "axis") for a in axes or ()]
    if len(set(dims)) != len(dims):
        raise ValueError(f"axes must not repeat a dim, got {axes}")
    rules.integer("keepdims", keepdims)
    rules.integer("noop_with_empty_axes", noop_with_empty_axes)


def _reduce(data, axes, *, keepdims, noop_with_empty_axes):
    axes = tuple(a % data.ndim for a in axes or ())
    return ref.reduce_sum_training(data, axes, int(keepdims), int(noop_with_empty_axes))


reduce_sum_training = define(
    "reduce_sum_training", ort=("com.microsoft", "ReduceSumTraining"),
    inputs=("data", "axes?: static"), outputs=("reduced",),
    attrs={"keepdims": 1, "noop_with_empty_axes": 0}, check=_check, reference=_reduce,
    doc="""ORT ReduceSumTraining: sum of `data` over `axes` (static ints, negative allowed).

    Empty axes (or None) reduce over every dim, or return data unchanged when
    noop_with_empty_axes=1. keepdims=1 keeps reduced dims as 1. float16/bfloat16 accumulate
    in f32; int32/int64 sum in their own dtype (wrapping on overflow, as ORT's kernels).
    """,
    matrix=Matrix(lambda rng, shape, dtype: (jnp.asarray(rng.standard_normal(shape), dtype),),
                  attrs={"axes": (-1,), "keepdims": 0}, grad=(0,)))

__all__ = ["reduce_sum_training"]
