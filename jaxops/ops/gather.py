"""GatherGrad, GatherElementsGrad, GatherNDGrad and SliceGrad (com.microsoft).

Shape-like inputs (`shape`; SliceGrad's starts, ends, axes, steps) are int64 tensors in ORT;
here they must be static: a tuple, list or concrete array, never a traced value, because they
fix the output's shape. Passing a traced one raises a TypeError naming the op.

Index rules (all four ops): a negative index is wrapped once (k + size); an index still outside
[0, size) is DROPPED: it adds nothing and touches no memory. (ORT's CPU kernel raises instead;
jaxops cannot raise on data under jit, and a clamp would add gradient to the wrong row.)

Determinism: GatherGrad runs the `jaxops_gather_grad` kernel, which sums the dY rows of each
output row in a fixed order (CPU: increasing position; CUDA: positions sorted by index with a
stable radix sort, then summed in that order in fixed chunks combined in chunk order), in f32
(f64 for f64). GatherElementsGrad and GatherNDGrad flatten their addressing into one row index
per dY element / slice and run the same kernel, so they are deterministic the same way.
SliceGrad writes each dY element to its own place (no duplicates): a zero pad, deterministic.

Differentiation: GatherGrad is linear in dY; its transpose is a gather (`gather_grad_transpose`,
plain XLA code) whose own transpose is the GatherGrad kernel, so gradients of any order run the
kernel in the scatter direction. The other three are compositions and inherit this.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops._src import rules
from jaxops._src.op import Factors, Op, is_undefined, is_zero
from jaxops._src.spec import Matrix, define
from jaxops.reference import gather as ref

_MS = "com.microsoft"
_INT32_MAX = np.iinfo(np.int32).max
# The matrix (tests/test_op_matrix.py) passes static inputs by name and calls with the array
# inputs by position, so an op whose static `shape` precedes an array input has no row there;
# tests/test_gather.py checks jit, vmap, vmap of grad, check_grads and sharding by hand.
_NO_MATRIX = ("its static `shape` input comes before an array input: the matrix passes static "
              "inputs by name after the positional arrays; tests/test_gather.py covers jit, "
              "vmap, vmap(grad), check_grads order 2 and sharding by hand")


def _wrap_or_drop(idx, size, dtype):
    """ref.wrap_or_drop in `dtype` (which holds `size`). The range check runs in the wider of
    idx's dtype and `dtype` BEFORE any narrowing: an int64 index such as 2**32 + 1 cast to
    int32 first would become 1 and add gradient to row 1 instead of being dropped."""
    wide = jnp.promote_types(idx.dtype, dtype)
    return ref.wrap_or_drop(idx.astype(wide), size).astype(dtype)


def _index_dtype(limit):
    """The index dtype that holds values up to `limit`."""
    if limit <= _INT32_MAX:
        return jnp.int32
    if not jax.config.jax_enable_x64:
        raise ValueError(f"indices up to {limit} need int64: enable jax_enable_x64")
    return jnp.int64


# ---------------------------------------------------------------------------------------------
# GatherGrad (the kernel) and its transpose, a gather


def _check_float(x, label):
    rules.floats(**{label: x})


def _check_index(x, label="indices"):
    if np.dtype(x.dtype) not in rules.INDEX:
        raise TypeError(f"{label} must be int32 or int64, got {x.dtype}")


def _gather_grad_shape(indices, dY, *, axis, v):
    """The kernel's params: `axis` (>= 0) and `v` = shape[axis]; dX's shape is dY's with the
    index dims replaced by v. (gather_grad checks the user's `shape` against dY first.)"""
    _check_index(indices)
    _check_float(dY, "dY")
    axis, v = int(axis), int(v)
    if not 0 <= axis <= dY.ndim - indices.ndim or v < 0:
        raise ValueError(f"dY of shape {dY.shape} does not fit indices of rank {indices.ndim} "
                         f"at axis {axis}")
    if tuple(dY.shape[axis:axis + indices.ndim]) != tuple(indices.shape):
        raise ValueError(f"dY's dims {axis}.. must be indices' shape {indices.shape}, "
                         f"got dY shape {dY.shape}")
    shape = dY.shape[:axis] + (v,) + dY.shape[axis + indices.ndim:]
    return jax.ShapeDtypeStruct(shape, dY.dtype)


def _gather_grad_factors(indices, dY, *, axis, v):
    n = tuple(f"n{j}" for j in range(indices.ndim))
    outer = tuple(f"o{d}" for d in range(axis))
    inner = tuple(f"i{d}" for d in range(dY.ndim - axis - indices.ndim))
    # The index dims are summed over and V is addressed by data: both stay whole.
    return Factors((n, outer + n + inner), (outer + ("v",) + inner,), n + ("v",))


def _fold(idx, size):
    """Per-example indices [B, ...] into one range of B * size rows: example b's valid index
    k becomes b * size + k; a dropped one stays out of range (B * size)."""
    batch = idx.shape[0]
    dtype = _index_dtype(batch * size)
    k = _wrap_or_drop(idx, size, dtype)
    base = lax.broadcasted_iota(dtype, idx.shape, 0) * size
    return jnp.where(k < size, k + base, batch * size)


def _front(x, dim, batch):
    return jnp.broadcast_to(x, (batch, *x.shape)) if dim is None else jnp.moveaxis(x, dim, 0)


def _gather_grad_batch(op, args, dims, *, axis, v):
    (idx, dy), (bi, bd) = args, dims
    if bi is None:  # one index set: the batch is one more outer dim
        return op.bind(idx, jnp.moveaxis(dy, bd, 0), axis=axis + 1, v=v), 0
    idx = jnp.moveaxis(idx, bi, 0)
    batch = idx.shape[0]
    dy = jnp.moveaxis(_front(dy, bd, batch), 0, axis)  # shape[:axis] + (B, *I) + rest
    out = op.bind(_fold(idx, v), dy, axis=axis, v=batch * v)
    out = out.reshape(*out.shape[:axis], batch, v, *out.shape[axis + 1:])
    return jnp.moveaxis(out, axis, 0), 0


def _gather_grad_jvp(op, primals, tangents, *, axis, v):
    (idx, dy), (_, t) = primals, tangents
    if is_zero(t):
        t = jnp.zeros(dy.shape, dy.dtype)
    return op.bind(idx, dy, axis=axis, v=v), op.bind(idx, t, axis=axis, v=v)


def _gather_grad_transpose(op, ct, idx, dy, *, axis, v):
    if is_undefined(idx) or not is_undefined(dy):
        raise NotImplementedError("gather_grad is linear in dY only")
    if is_zero(ct):
        return None, None
    return None, _GATHER.bind(ct, idx, axis=axis)


def _gather_grad_reference(idx, dy, *, axis, v):
    shape = dy.shape[:axis] + (v,) + dy.shape[axis + idx.ndim:]
    return ref.gather_grad(shape, idx, dy, axis)


_GATHER_GRAD = Op(
    "gather_grad", shape=_gather_grad_shape, reference=_gather_grad_reference,
    batch=_gather_grad_batch, target="jaxops_gather_grad",
    ffi_attrs=lambda idx, dy, *, axis, v: {"axis": np.int64(axis), "v": np.int64(v)},
    factors=_gather_grad_factors, jvp=_gather_grad_jvp, transpose=_gather_grad_transpose)


def _gather_shape(x, indices, *, axis):
    _check_float(x, "x")
    _check_index(indices)
    if x.ndim == 0:
        raise ValueError("x must have rank >= 1")
    if not 0 <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for rank {x.ndim}")
    return jax.ShapeDtypeStruct(x.shape[:axis] + indices.shape + x.shape[axis + 1:], x.dtype)


def _gather_batch(op, args, dims, *, axis):
    (x, idx), (bx, bi) = args, dims
    if bi is None:
        return op.bind(jnp.moveaxis(x, bx, 0), idx, axis=axis + 1), 0
    idx = jnp.moveaxis(idx, bi, 0)
    batch = idx.shape[0]
    x = jnp.moveaxis(_front(x, bx, batch), 0, axis)  # x[:axis] + (B, V) + rest
    size = x.shape[axis + 1]
    x = x.reshape(*x.shape[:axis], batch * size, *x.shape[axis + 2:])
    return jnp.moveaxis(op.bind(x, _fold(idx, size), axis=axis), axis, 0), 0


def _gather_jvp(op, primals, tangents, *, axis):
    (x, idx), (t, _) = primals, tangents
    if is_zero(t):
        t = jnp.zeros(x.shape, x.dtype)
    return op.bind(x, idx, axis=axis), op.bind(t, idx, axis=axis)


def _gather_transpose(op, ct, x, idx, *, axis):
    if is_undefined(idx) or not is_undefined(x):
        raise NotImplementedError("gather_grad_transpose is linear in x only")
    if is_zero(ct):
        return None, None
    return _GATHER_GRAD.bind(idx, ct, axis=axis, v=x.aval.shape[axis]), None


# The adjoint of GatherGrad in dY: a gather with the same index rules (0 for a dropped index),
# lowered as XLA code; its own adjoint is the GatherGrad kernel.
_GATHER = Op("gather_grad_transpose", shape=_gather_shape,
             reference=lambda x, idx, *, axis: ref.gather(x, idx, axis),
             impl=lambda x, idx, *, axis: ref.gather(x, idx, axis),
             batch=_gather_batch, jvp=_gather_jvp, transpose=_gather_transpose)


def _check_gather_grad(shape, indices, dY, *, axis):
    if not shape:
        raise ValueError("shape must have rank >= 1")
    if any(d < 0 for d in shape):
        raise ValueError(f"shape must not hold negative dims, got {shape}")
    axis = rules.axis(axis, len(shape))
    want = shape[:axis] + tuple(indices.shape) + shape[axis + 1:]
    if tuple(dY.shape) != want:
        raise ValueError(f"dY must have shape shape[:axis] + indices.shape + shape[axis+1:] = "
                         f"{want}, got {tuple(dY.shape)}")


def _gather_grad(shape, indices, dY, *, axis):
    axis = int(axis) % len(shape)
    if indices.ndim == 0:  # one index: a length-1 index axis keeps the kernel's view simple
        indices, dY = indices.reshape(1), jnp.expand_dims(dY, axis)
    return _GATHER_GRAD.bind(indices, dY, axis=axis, v=shape[axis])


gather_grad = define(
    "gather_grad", ort=(_MS, "GatherGrad"), inputs=("shape: static", "indices: index", "dY: float"),
    outputs=("dX",), attrs={"axis": 0}, check=_check_gather_grad, kernel=_gather_grad,
    reference=lambda shape, indices, dY, *, axis: ref.gather_grad(shape, indices, dY, axis),
    doc="""ORT GatherGrad: dX = zeros(shape); dX[..., indices[p], ...] += dY[..., p, ...] along
    `axis`, for every position p of `indices` (any shape; dY's shape is
    shape[:axis] + indices.shape + shape[axis+1:]).

    `shape` (the forward input's shape) must be static. int32/int64 indices; f32, f64, f16,
    bf16 dY (f32 accumulation, f64 for f64). Negative indices wrap once; an index still out
    of range is dropped (never clamped, never read or written out of bounds). Duplicates are
    summed deterministically: the same bits every run (see the module docstring).
    """,
    no_matrix=_NO_MATRIX)


def gather_grad_transpose(x, indices, axis=0):
    """Not an ORT op: the adjoint of gather_grad in dY, a gather along `axis` with its index
    rules (negative indices wrap once; a dropped index gives 0). Its adjoint is gather_grad."""
    x, indices = jnp.asarray(x), jnp.asarray(indices)
    with rules.named("gather_grad_transpose"):
        axis = rules.axis(axis, max(x.ndim, 1))
    return _GATHER(x, indices, axis=axis)


# ---------------------------------------------------------------------------------------------
# GatherElementsGrad and GatherNDGrad: a flat row index per element / slice, then the kernel


def _strides(shape):
    out, s = [], 1
    for d in reversed(shape):
        out.append(s)
        s *= d
    return out[::-1]


def _check_gather_elements_grad(dY, shape, indices, *, axis):
    if not shape:
        raise ValueError("shape must have rank >= 1")
    rules.same_shape(indices=indices, dY=dY)
    if dY.ndim != len(shape):
        raise ValueError(f"dY must have the rank of shape ({len(shape)}), got rank {dY.ndim}")
    axis = rules.axis(axis, len(shape))
    if any(dY.shape[d] > shape[d] for d in range(len(shape)) if d != axis):
        raise ValueError(f"dY's dims other than axis {axis} must not exceed shape's: "
                         f"{dY.shape} vs {shape}")


def _gather_elements_grad(dY, shape, indices, *, axis):
    return _gather_elements_grad_jit(dY, indices, shape, int(axis) % len(shape))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _gather_elements_grad_jit(dY, indices, shape, axis):
    total = math.prod(shape)
    dtype = _index_dtype(total)
    flat = jnp.zeros(dY.shape, dtype)
    for d, stride in enumerate(_strides(shape)):
        if d != axis:
            flat = flat + lax.broadcasted_iota(dtype, dY.shape, d) * stride
    k = _wrap_or_drop(indices, shape[axis], dtype)
    flat = jnp.where(k < shape[axis], flat + k * _strides(shape)[axis], total)
    out = _GATHER_GRAD.bind(flat.reshape(-1), dY.reshape(-1), axis=0, v=total)
    return out.reshape(shape)


gather_elements_grad = define(
    "gather_elements_grad", ort=(_MS, "GatherElementsGrad"),
    inputs=("dY: float", "shape: static", "indices: index"), outputs=("dX",), attrs={"axis": 0},
    check=_check_gather_elements_grad, kernel=_gather_elements_grad,
    reference=lambda dY, shape, indices, *, axis: ref.gather_elements_grad(dY, shape, indices,
                                                                            axis),
    doc="""ORT GatherElementsGrad: dX = zeros(shape); for every position i of dY (and indices,
    same shape), dX[i with i[axis] replaced by indices[i]] += dY[i].

    `shape` must be static; dY's dims may be smaller than shape's except along `axis`
    (GatherElements' rule). Negative indices wrap; an out-of-range index is dropped.
    Deterministic: each element's flat position in dX is one row index for the GatherGrad
    kernel (a 1-D scatter of single elements), which sums duplicates in a fixed order.
    """,
    no_matrix=_NO_MATRIX)


def _check_gather_nd_grad(shape, indices, update, *, batch_dims):
    b = rules.integer("batch_dims", batch_dims)
    if indices.ndim < 1:
        raise ValueError("indices must have rank >= 1")
    k = indices.shape[-1]
    if not 0 <= b < indices.ndim:
        raise ValueError(f"batch_dims {b} must be in [0, indices rank {indices.ndim})")
    if b + k > len(shape):
        raise ValueError(f"batch_dims + indices.shape[-1] = {b + k} exceeds rank {len(shape)}")
    if tuple(indices.shape[:b]) != shape[:b]:
        raise ValueError(f"indices' batch dims {indices.shape[:b]} differ from shape's "
                         f"{shape[:b]}")
    want = tuple(indices.shape[:-1]) + shape[b + k:]
    if tuple(update.shape) != want:
        raise ValueError(f"update must have shape indices.shape[:-1] + shape[batch_dims+k:] = "
                         f"{want}, got {tuple(update.shape)}")


def _gather_nd_grad(shape, indices, update, *, batch_dims):
    return _gather_nd_grad_jit(indices, update, shape, int(batch_dims))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _gather_nd_grad_jit(indices, update, shape, b):
    k = indices.shape[-1]
    sub, rest = shape[b:b + k], math.prod(shape[b + k:])
    rows = math.prod(shape[:b + k])
    dtype = _index_dtype(rows)
    lead = indices.shape[:-1]
    row = jnp.zeros(lead, dtype)
    bad = jnp.zeros(lead, bool)
    for j, stride in enumerate(_strides(sub)):
        c = _wrap_or_drop(indices[..., j], sub[j], dtype)
        bad = bad | (c == sub[j])
        row = row + c * stride
    for d, stride in enumerate(_strides(shape[:b])):  # batch position, in whole sub-blocks
        row = row + lax.broadcasted_iota(dtype, lead, d) * (stride * math.prod(sub))
    row = jnp.where(bad, rows, row).reshape(-1)
    out = _GATHER_GRAD.bind(row, update.reshape(row.shape[0], rest), axis=0, v=rows)
    return out.reshape(shape)


gather_nd_grad = define(
    "gather_nd_grad", ort=(_MS, "GatherNDGrad"),
    inputs=("shape: static", "indices: index", "update: float"), outputs=("output",),
    attrs={"batch_dims": 0}, check=_check_gather_nd_grad, kernel=_gather_nd_grad,
    reference=lambda shape, indices, update, *, batch_dims: ref.gather_nd_grad(
        shape, indices, update, int(batch_dims)),
    doc="""ORT GatherNDGrad: dX = zeros(shape); update's slices are added where GatherND with
    `batch_dims` would have read them: indices [B..., G..., k] (B = shape[:batch_dims]),
    update B + G + shape[batch_dims+k:]; duplicates accumulate.

    `shape` must be static. Each index component wraps once when negative; a tuple with a
    component still out of range is dropped. Deterministic: every tuple becomes one flat row
    of dX viewed as [rows, slice], run through the GatherGrad kernel.
    """,
    no_matrix=_NO_MATRIX)


# ---------------------------------------------------------------------------------------------
# SliceGrad


def _check_slice_grad(dY, shape, starts, ends, axes, steps):
    if len(ends) != len(starts):
        raise ValueError(f"starts and ends must have one length, got {len(starts)} and "
                         f"{len(ends)}")
    for label, v in (("axes", axes), ("steps", steps)):
        if v is not None and len(v) != len(starts):
            raise ValueError(f"{label} must have the length of starts ({len(starts)}), got "
                             f"{len(v)}")
    rank = len(shape)
    if axes is not None:
        if any(not -rank <= a < rank for a in axes):
            raise ValueError(f"axes {axes} out of range for rank {rank}")
        if len({a % rank for a in axes}) != len(axes):
            raise ValueError(f"axes {axes} repeat a dim")
    elif len(starts) > rank:
        raise ValueError(f"{len(starts)} starts for rank {rank}")
    if steps is not None and 0 in steps:
        raise ValueError("steps must be nonzero")
    counts = tuple(ref.slice_count(*r) for r in ref.slice_ranges(shape, starts, ends, axes, steps))
    if tuple(dY.shape) != counts:
        raise ValueError(f"dY must have the sliced shape {counts}, got {tuple(dY.shape)}")


def _slice_grad(dY, shape, starts, ends, axes, steps):
    ranges = tuple(ref.slice_ranges(shape, starts, ends, axes, steps))
    return _slice_pad(dY, shape, ranges, tuple(ref.slice_count(*r) for r in ranges))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _slice_pad(dY, shape, ranges, counts):
    if 0 in counts:
        return jnp.zeros(shape, dY.dtype)
    config = []
    for d, ((start, _, step), count, size) in enumerate(zip(ranges, counts, shape)):
        last = start + (count - 1) * step
        if step < 0:
            dY = jnp.flip(dY, d)
            start, last = last, start
        config.append((start, size - 1 - last, abs(step) - 1))
    return lax.pad(dY, jnp.zeros((), dY.dtype), config)


def _slice_make(rng, shape, dtype):
    # `shape` is a static input (fixed in the row's keywords), so dY is always the [8, 3] it
    # slices to; dim 0 is the one the sharded check splits
    return (jnp.asarray(rng.standard_normal((8, 3)), dtype),)


slice_grad = define(
    "slice_grad", ort=(_MS, "SliceGrad"),
    inputs=("dY", "shape: static", "starts: static", "ends: static", "axes?: static",
            "steps?: static"), outputs=("dX",),
    check=_check_slice_grad, reference=_slice_grad,
    doc="""ORT SliceGrad: dX = zeros(shape); dX[Slice(starts, ends, axes, steps)] = dY.

    ONNX Slice-10+ addressing: negative starts/ends count from the end and are clamped,
    negative steps walk backwards, `axes` (default 0..len(starts)-1) may be negative. All of
    shape, starts, ends, axes, steps must be static. Any dtype. The sliced elements are
    distinct, so dX is a zero pad of dY (interior padding for |step| > 1, dY flipped for
    negative steps): deterministic, and XLA fuses it (XLA code: there is no kernel).
    """,
    matrix=Matrix(_slice_make, attrs={"shape": (8, 7), "starts": (5,), "ends": (-100,),
                                      "axes": (1,), "steps": (-2,)}, grad=(0,)))


__all__ = ["gather_elements_grad", "gather_grad", "gather_nd_grad", "slice_grad"]
