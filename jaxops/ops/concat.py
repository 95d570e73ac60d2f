"""ConcatTraining and SplitTraining (com.microsoft).

Both move bytes only: one FFI kernel each (ffi/*/concat.*), any dtype ORT allows that JAX has
(float16, bfloat16, float32, float64, int8..int64, uint8..uint64, bool). On CUDA one launch
copies every piece (ffi/cuda/concat.cu).

Differentiation: both are linear. Concat's jvp concatenates the tangents and its transpose is
Split; Split's jvp splits the tangent and its transpose is Concat. So reverse mode of one runs
the other's kernel, and gradients of any order exist.

Sizes are static in JAX: ConcatTraining's `per_input_length` is returned as a numpy int64
array (known at trace time), and SplitTraining's `split` input must be concrete (a tuple,
list, numpy or concrete jax array), so that the graph ORT builds (SplitTraining fed by
ConcatTraining's per_input_length) traces under jit.
"""
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._src.op import Factors, Op, batch_at_front, is_undefined, is_zero
from jaxops.ops._args import named, static_ints, static_inputs
from jaxops.reference import concat as ref

_DTYPES = tuple(np.dtype(d) for d in (
    jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.int8, jnp.int16, jnp.int32,
    jnp.int64, jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64, jnp.bool_))


def _check_axis(axis, ndim):
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"axis must be an int, got {axis!r}") from None
    if ndim == 0:
        raise ValueError("inputs must have rank >= 1, got a scalar")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for rank {ndim}")
    return axis % ndim


def _check_dtype(x, label):
    if np.dtype(x.dtype) not in _DTYPES:
        raise TypeError(f"{label} has unsupported dtype {x.dtype} (floats, ints, bool)")


def _concat_shape(*xs, axis):
    if not xs:
        raise ValueError("needs at least one input")
    first = xs[0]
    for i, x in enumerate(xs):
        _check_dtype(x, f"input {i}")
        if x.dtype != first.dtype:
            raise TypeError(f"inputs must share one dtype, got {first.dtype} and {x.dtype} "
                            f"(input {i})")
        if x.ndim != first.ndim:
            raise ValueError(f"inputs must share one rank, got {first.ndim} and {x.ndim} "
                             f"(input {i})")
    axis = _check_axis(axis, first.ndim)
    for i, x in enumerate(xs):
        if x.shape[:axis] + x.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:]:
            raise ValueError(f"inputs may differ only along axis {axis}, got {first.shape} and "
                             f"{x.shape} (input {i})")
    shape = list(first.shape)
    shape[axis] = sum(x.shape[axis] for x in xs)
    return jax.ShapeDtypeStruct(tuple(shape), first.dtype)


def _split_shape(x, *, sizes, axis):
    _check_dtype(x, "input")
    axis = _check_axis(axis, x.ndim)
    if not sizes:
        raise ValueError("needs at least one output")
    if any(s < 0 for s in sizes):
        raise ValueError(f"split sizes must be >= 0, got {list(sizes)}")
    if sum(sizes) != x.shape[axis]:
        raise ValueError(f"split sizes {list(sizes)} add up to {sum(sizes)}, not to the "
                         f"input's extent {x.shape[axis]} along axis {axis}")
    return tuple(jax.ShapeDtypeStruct(x.shape[:axis] + (s,) + x.shape[axis + 1:], x.dtype)
                 for s in sizes)


def _dims(ndim, axis, name):
    return tuple(name if i == axis else f"d{i}" for i in range(ndim))


def _concat_factors(*xs, axis):
    axis %= xs[0].ndim
    names = [f"a{k}" for k in range(len(xs))]  # the extents along axis differ: one factor each
    operands = tuple(_dims(x.ndim, axis, n) for x, n in zip(xs, names))
    return Factors(operands, (_dims(xs[0].ndim, axis, "whole"),), tuple(names) + ("whole",))


def _split_factors(x, *, sizes, axis):
    axis %= x.ndim
    names = [f"a{k}" for k in range(len(sizes))]
    results = tuple(_dims(x.ndim, axis, n) for n in names)
    # Shardy wants the replicated factors in order of first appearance
    return Factors((_dims(x.ndim, axis, "whole"),), results, ("whole",) + tuple(names))


def _shape_of(x):
    return x.aval.shape if is_undefined(x) else x.shape


def _float0_like(x):
    return np.zeros(x.shape, jax.dtypes.float0)


def _concat_batch(op, args, dims, *, axis):
    args = batch_at_front(args, dims)
    return op.bind(*args, axis=axis % (args[0].ndim - 1) + 1), 0


def _concat_jvp(op, primals, tangents, *, axis):
    out = op.bind(*primals, axis=axis)
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        return out, _float0_like(out)
    tangents = [jnp.zeros(p.shape, p.dtype) if is_zero(t) else t
                for p, t in zip(primals, tangents)]
    return out, op.bind(*tangents, axis=axis)


def _concat_transpose(op, ct, *xs, axis):
    if is_zero(ct):
        return [None] * len(xs)
    axis %= ct.ndim
    sizes = tuple(_shape_of(x)[axis] for x in xs)
    pieces = _SPLIT.bind(ct, sizes=sizes, axis=axis)
    return [p if is_undefined(x) else None for p, x in zip(pieces, xs)]


def _split_batch(op, args, dims, *, sizes, axis):
    (x,) = batch_at_front(args, dims)
    return op.bind(x, sizes=sizes, axis=axis % (x.ndim - 1) + 1), [0] * len(sizes)


def _split_jvp(op, primals, tangents, *, sizes, axis):
    (x,), (t,) = primals, tangents
    outs = op.bind(x, sizes=sizes, axis=axis)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return outs, [_float0_like(o) for o in outs]
    if is_zero(t):
        t = jnp.zeros(x.shape, x.dtype)
    return outs, list(op.bind(t, sizes=sizes, axis=axis))


def _split_transpose(op, cts, x, *, sizes, axis):
    if all(is_zero(c) for c in cts):
        return [None]
    shape = _shape_of(x)
    axis %= len(shape)
    dtype = next(c.dtype for c in cts if not is_zero(c))
    cts = [jnp.zeros(shape[:axis] + (s,) + shape[axis + 1:], dtype) if is_zero(c) else c
           for c, s in zip(cts, sizes)]
    return [_CONCAT.bind(*cts, axis=axis)]


_CONCAT = Op("concat_training", shape=_concat_shape, reference=ref.concat, batch=_concat_batch,
             target="jaxops_concat_training",
             ffi_attrs=lambda *xs, axis: {"axis": np.int64(axis % xs[0].ndim)},
             factors=_concat_factors, jvp=_concat_jvp, transpose=_concat_transpose)
_SPLIT = Op("split_training", shape=_split_shape, reference=ref.split, batch=_split_batch,
            target="jaxops_split_training",
            ffi_attrs=lambda x, *, sizes, axis: {"axis": np.int64(axis % x.ndim)},
            factors=_split_factors, jvp=_split_jvp, transpose=_split_transpose,
            multiple_results=True)


def concat_training(*inputs, axis):
    """ORT ConcatTraining: (concat_result, per_input_length).

    concat_result joins `inputs` along `axis` (required, negative allowed); per_input_length
    is each input's extent along `axis`, a numpy int64 array of shape [len(inputs)] (static:
    it is known at trace time and feeds SplitTraining).
    """
    out = _CONCAT(*inputs, axis=axis)
    axis = operator.index(axis) % out.ndim
    lengths = np.array([jnp.shape(x)[axis] for x in inputs], np.int64)
    return out, lengths


def _static_sizes(split, extent, num_outputs):
    """The output extents from ORT's `split` input (static) and the output count."""
    sizes = static_ints([] if split is None else split, "split")
    if num_outputs is not None:
        num_outputs = operator.index(num_outputs)
        if num_outputs < 1:
            raise ValueError(f"num_outputs must be >= 1, got {num_outputs}")
        if sizes and len(sizes) != num_outputs:
            raise ValueError(f"split has {len(sizes)} entries but num_outputs is {num_outputs}")
    if sizes:
        return sizes
    if num_outputs is None:
        raise ValueError("an empty split needs num_outputs (ORT: the node's output count)")
    if extent % num_outputs:
        # ORT's kernel refuses this (its schema's shape inference would make the first
        # outputs one longer, but no output is ever computed that way)
        raise ValueError(f"an empty split needs the extent {extent} to divide evenly into "
                         f"num_outputs={num_outputs} parts (ORT refuses it too)")
    return (extent // num_outputs,) * num_outputs


@static_inputs('split')
def split_training(input, split, axis=0, num_outputs=None):
    """ORT SplitTraining: `input` cut along `axis` into pieces of extents `split`.

    `split` is ORT's int64 input, static here (see the module docstring). An empty `split`
    (or None) means `num_outputs` equal parts; an extent that does not divide evenly is an
    error, as in ORT's kernel. Returns a tuple of the pieces.
    """
    x = jnp.asarray(input)
    with named("split_training"):
        sizes = _static_sizes(split, x.shape[_check_axis(axis, x.ndim)], num_outputs)
    return _SPLIT(x, sizes=sizes, axis=axis)


__all__ = ["concat_training", "split_training"]

ORT_OPS = {
    ("com.microsoft", "ConcatTraining"): concat_training,
    ("com.microsoft", "SplitTraining"): split_training,
}
