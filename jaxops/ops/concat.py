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

from jaxops._src import rules
from jaxops._src.op import Factors, Op, batch_at_front, is_undefined, is_zero, shape_of
from jaxops._src.spec import REQUIRED, Matrix, define
from jaxops.reference import concat as ref

_MS = "com.microsoft"

# what the byte-moving kernels take (ffi/include/jaxops/checks.h's kWholeByteTypes has more)
BYTE_DTYPES = tuple(np.dtype(d) for d in (
    jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.int8, jnp.int16, jnp.int32,
    jnp.int64, jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64, jnp.bool_))


def _check_axis(axis, ndim):
    rules.integer("axis", axis)
    if ndim == 0:
        raise ValueError("inputs must have rank >= 1, got a scalar")
    return rules.axis(axis, ndim)


def _check_dtype(x, label):
    if np.dtype(x.dtype) not in BYTE_DTYPES:
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
    sizes = tuple(shape_of(x)[axis] for x in xs)
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
    shape = shape_of(x)
    axis %= len(shape)
    dtype = next(c.dtype for c in cts if not is_zero(c))
    cts = [jnp.zeros(shape[:axis] + (s,) + shape[axis + 1:], dtype) if is_zero(c) else c
           for c, s in zip(cts, sizes)]
    return [_CONCAT.bind(*cts, axis=axis)]


_CONCAT = Op("concat_training", shape=_concat_shape, reference=ref.concat, batch=_concat_batch,
             target="jaxops_concat_training",
             ffi_attrs=lambda *xs, axis: {"axis": np.int64(axis % xs[0].ndim)},
             factors=_concat_factors, jvp=_concat_jvp, transpose=_concat_transpose,
             # H100: XLA's concatenate won at every bench shape (0.67-0.92x for the kernel,
             # docs/performance.md), and inside a jitted step it fuses with its producers
             xla_when=lambda platform, *avals, axis: platform == "cuda")
_SPLIT = Op("split_training", shape=_split_shape, reference=ref.split, batch=_split_batch,
            target="jaxops_split_training",
            ffi_attrs=lambda x, *, sizes, axis: {"axis": np.int64(axis % x.ndim)},
            factors=_split_factors, jvp=_split_jvp, transpose=_split_transpose,
            multiple_results=True,
            # H100 [4096,8192] in 8 pieces: the kernel wins in f32 (1.09x XLA), XLA in bf16
            # (0.93x; docs/performance.md)
            xla_when=lambda platform, x, *, sizes, axis: platform == "cuda"
            and np.dtype(x.dtype).itemsize < 4)


def _lengths(inputs, axis):
    axis = operator.index(axis) % inputs[0].ndim
    return np.array([x.shape[axis] for x in inputs], np.int64)


def _pieces(widths):
    """Matrix inputs: pieces of the given widths along the last dim."""
    return lambda rng, shape, dtype: tuple(
        jnp.asarray(rng.standard_normal((*shape, w)), dtype) for w in widths)


concat_training = define(
    "concat_training", ort=(_MS, "ConcatTraining"), inputs=("*inputs",),
    outputs=("concat_result", "per_input_length"), attrs={"axis": REQUIRED},
    check=lambda *inputs, axis: _CONCAT.check(*inputs, axis=axis),
    kernel=lambda *inputs, axis: (_CONCAT.bind(*inputs, axis=axis), _lengths(inputs, axis)),
    reference=lambda *inputs, axis: (ref.concat(*inputs, axis=axis), _lengths(inputs, axis)),
    doc="""ORT ConcatTraining: (concat_result, per_input_length).

    concat_result joins `inputs` along `axis` (required, negative allowed); per_input_length
    is each input's extent along `axis`, a numpy int64 array of shape [len(inputs)] (static:
    it is known at trace time and feeds SplitTraining).
    """,
    matrix=Matrix(_pieces((2, 3)), attrs={"axis": -1}, grad=(0, 1)))


def _sizes(x, split, axis, num_outputs):
    """The output extents from ORT's `split` input (static) and the output count."""
    extent = x.shape[_check_axis(axis, x.ndim)]
    if num_outputs is not None:
        num_outputs = rules.integer("num_outputs", num_outputs)
        if num_outputs < 1:
            raise ValueError(f"num_outputs must be >= 1, got {num_outputs}")
        if split and len(split) != num_outputs:
            raise ValueError(f"split has {len(split)} entries but num_outputs is {num_outputs}")
    if split:
        return split
    if num_outputs is None:
        raise ValueError("an empty split needs num_outputs (ORT: the node's output count)")
    if extent % num_outputs:
        # ORT's kernel refuses this (its schema's shape inference would make the first
        # outputs one longer, but no output is ever computed that way)
        raise ValueError(f"an empty split needs the extent {extent} to divide evenly into "
                         f"num_outputs={num_outputs} parts (ORT refuses it too)")
    return (extent // num_outputs,) * num_outputs


def _check_split(input, split, *, axis, num_outputs):
    _SPLIT.check(input, sizes=_sizes(input, split, axis, num_outputs), axis=axis)


def _split(run):
    return lambda input, split, *, axis, num_outputs: run(
        input, sizes=_sizes(input, split, axis, num_outputs), axis=axis)


split_training = define(
    "split_training", ort=(_MS, "SplitTraining"), inputs=("input", "split: static"),
    outputs=("outputs",), attrs={"axis": 0}, options={"num_outputs": None},
    check=_check_split, kernel=_split(_SPLIT.bind), reference=_split(ref.split),
    # an empty split needs ORT's output count, the node's: the importer passes it
    graph=lambda ctx, input, split: {} if np.size(split) else {"num_outputs": ctx.num_outputs},
    doc="""ORT SplitTraining: `input` cut along `axis` into pieces of extents `split`.

    `split` is ORT's int64 input, static here (see the module docstring). An empty `split`
    means `num_outputs` equal parts (ORT: the node's output count); an extent that does not
    divide evenly is an error, as in ORT's kernel. Returns a tuple of the pieces.
    """,
    matrix=Matrix(_pieces((5,)), attrs={"split": (2, 3), "axis": -1}, grad=(0,)))


__all__ = ["concat_training", "split_training"]
