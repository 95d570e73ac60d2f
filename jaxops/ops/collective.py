"""NcclAllReduce, NcclAllGather, NcclReduceScatter, MegatronF, MegatronG, AdasumAllReduce
(com.microsoft) on JAX's own collectives.

ORT runs these on its NCCL/MPI communicators; here they are `psum` / `all_gather` /
`psum_scatter` / `ppermute` over a named mesh axis, so they run wherever XLA's collectives
run: NCCL on GPUs, in-process on CPU, across hosts through `jax.distributed`. Call them
inside `jax.shard_map` (or `pmap`) where the axis is bound.

ORT's `group_type` picks a worker group; it maps to a mesh axis name through `GROUP_AXES`
(0, data parallel -> "data"; 1, horizontal/tensor parallel -> "model"). Override it for one
call with `axis_name=`, or for a block of code (an import, a training step) with
`with group_axes({0: "batch"}): ...`.

Several inputs travel in one collective, as ORT packs them into one buffer: all-reduce uses
one variadic all-reduce, all-gather and reduce-scatter one packed buffer with ORT's layout.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxops._src.compat import mark_varying, varying_axes
from jaxops._src.spec import define

GROUP_AXES = {0: "data", 1: "model"}
_axes = contextvars.ContextVar("jaxops_group_axes", default=None)
_SLICE = 32  # ORT pads the fused buffer to a multiple of world_size * 32 elements
_MS = "com.microsoft"
# why no collective has a row in the generic transformation matrix (tests/test_op_matrix.py)
_NO_MATRIX = ("a collective over a named mesh axis: it runs only inside jax.shard_map/pmap "
              "with that axis bound, which the generic matrix does not set up; "
              "tests/test_collective.py checks it per rank, with check_grads and vmap there")


@contextlib.contextmanager
def group_axes(mapping: dict[int, str]):
    """Maps ORT group types to mesh axis names inside the block (on top of GROUP_AXES)."""
    token = _axes.set({**(_axes.get() or GROUP_AXES), **mapping})
    try:
        yield
    finally:
        _axes.reset(token)


def axis_for(group_type: int, axis_name=None):
    """The mesh axis (or axes) that ORT's worker group `group_type` runs over."""
    if axis_name is not None:
        return axis_name
    mapping = _axes.get() or GROUP_AXES
    if group_type not in mapping:
        raise ValueError(f"group_type {group_type} has no mesh axis (mapping: {mapping}); "
                         "pass axis_name= or use jaxops.ops.group_axes")
    return mapping[group_type]


def _axis_size(axis):
    try:
        return lax.axis_size(axis)
    except NameError as e:
        raise ValueError(f"mesh axis {axis!r} is not bound; call it inside jax.shard_map (or "
                         "pmap) over a mesh with that axis") from e


def _group(inputs, group_type, axis_name, one_buffer):
    """The checks every collective shares: at least one input (ORT's packed ones of one dtype),
    a group whose mesh axis is bound. Returns (axis, world size)."""
    if not inputs:
        raise ValueError("needs at least one input")
    if one_buffer and len({x.dtype for x in inputs}) > 1:
        raise TypeError(f"ORT packs the inputs into one buffer of one type; got "
                        f"{sorted({str(x.dtype) for x in inputs})}")
    axis = axis_for(group_type, axis_name)
    return axis, _axis_size(axis)


def _result(outputs):
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _all_reduce_check(*input, group_type, axis_name):
    _group(input, group_type, axis_name, one_buffer=False)


def _all_reduce(*input, group_type, axis_name):
    return _result(list(lax.psum(tuple(input), axis_for(group_type, axis_name))))


nccl_all_reduce = define(
    "nccl_all_reduce", ort=(_MS, "NcclAllReduce"), inputs=("*input: float",),
    outputs=("output",), attrs={"group_type": 0}, options={"axis_name": None},
    check=_all_reduce_check, reference=_all_reduce, no_matrix=_NO_MATRIX,
    doc="""Sum of each input over the group (no averaging). One all-reduce for all inputs.""")


def _layout(inputs, world):
    """ORT's fused layout: the inputs back to back, padded to world * 32 * k elements; rank r
    owns elements [r * per_rank, (r + 1) * per_rank); a tensor belongs to the rank where it
    starts and must end there too. Returns (per_rank, starts, sizes)."""
    sizes = [int(x.size) for x in inputs]
    total = sum(sizes)
    per_rank = max(1, math.ceil(total / (world * _SLICE))) * _SLICE
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for i, (s, n) in enumerate(zip(starts, sizes)):
        owner = s // per_rank
        if n and (s + n - 1) // per_rank != owner:
            raise ValueError(f"input {i} ({n} elements at offset {s}) straddles the ranges of "
                             f"ranks {owner} and {(s + n - 1) // per_rank} ({per_rank} elements "
                             "each); ORT requires each tensor to lie in one rank's range")
    return per_rank, starts, sizes


def _packed(inputs, group_type, axis_name):
    axis = axis_for(group_type, axis_name)
    world = lax.axis_size(axis)
    per_rank, starts, sizes = _layout(inputs, world)
    buffer = jnp.concatenate([x.ravel() for x in inputs]
                             + [jnp.zeros(world * per_rank - sum(sizes), inputs[0].dtype)])
    return axis, buffer, per_rank, starts, sizes


def _unpack(buffer, inputs, starts, sizes):
    return [buffer[s:s + n].reshape(x.shape) for x, s, n in zip(inputs, starts, sizes)]


def _packed_check(*input, group_type, axis_name):
    _, world = _group(input, group_type, axis_name, one_buffer=True)
    _layout(input, world)


def _all_gather(*input, group_type, axis_name):
    axis, buffer, per_rank, starts, sizes = _packed(input, group_type, axis_name)
    mine = lax.dynamic_slice_in_dim(buffer, lax.axis_index(axis) * per_rank, per_rank)
    full = lax.all_gather(mine, axis, tiled=True)
    return _result(_unpack(full, input, starts, sizes))


nccl_all_gather = define(
    "nccl_all_gather", ort=(_MS, "NcclAllGather"), inputs=("*input: float",),
    outputs=("output",), attrs={"group_type": 0}, options={"axis_name": None},
    check=_packed_check, reference=_all_gather, no_matrix=_NO_MATRIX,
    doc="""Every output i takes input i's value from the rank whose range holds tensor i (ORT's
    ZeRO layout: the inputs packed back to back, padded to world * 32 * k elements, rank r
    owning elements [r * per_rank, (r + 1) * per_rank); a tensor must lie in one rank's
    range): one all-gather of the packed buffer.""")


def _reduce_scatter(*input, group_type, axis_name):
    axis, buffer, per_rank, starts, sizes = _packed(input, group_type, axis_name)
    summed = lax.psum_scatter(buffer, axis, tiled=True)
    full = lax.dynamic_update_slice_in_dim(buffer, summed, lax.axis_index(axis) * per_rank, 0)
    return _result(_unpack(full, input, starts, sizes))


nccl_reduce_scatter = define(
    "nccl_reduce_scatter", ort=(_MS, "NcclReduceScatter"), inputs=("*input: float",),
    outputs=("output",), attrs={"group_type": 0}, options={"axis_name": None},
    check=_packed_check, reference=_reduce_scatter, no_matrix=_NO_MATRIX,
    doc="""Tensors in this rank's range of the packed buffer (ORT's layout, as in
    nccl_all_gather) receive their sum over the group; every other output is a copy of its
    input (ORT's semantics): one reduce-scatter.""")


@functools.cache
def _megatron(axis, forward_sum: bool, vma: frozenset):
    """Identity one way, sum over `axis` the other. A gradient is cast back to its operand's
    varying type (the sum is the same on every rank), so shard_map's type check holds
    whether or not the operand varies over `axis`."""
    operand_axes = vma & ({axis} if isinstance(axis, str) else set(axis))

    @jax.custom_vjp
    def f(x):
        return lax.psum(x, axis) if forward_sum else x

    def fwd(x):
        return f(x), None

    def bwd(_, ct):
        if forward_sum:  # g: the gradient passes through
            return (mark_varying(ct, operand_axes - varying_axes(ct)),)
        return (mark_varying(lax.psum(ct, axis), operand_axes),)  # f: it is summed

    f.defvjp(fwd, bwd)
    return f


megatron_f = define(
    "megatron_f", ort=(_MS, "MegatronF"), inputs=("input: float",), outputs=("output",),
    options={"axis_name": None},
    check=lambda input, *, axis_name: _group([input], 1, axis_name, one_buffer=False),
    reference=lambda input, *, axis_name: _megatron(
        axis_for(1, axis_name), False, varying_axes(input))(input),
    no_matrix=_NO_MATRIX,
    doc="""Megatron's f: identity forward, all-reduce (sum) of the gradient over the horizontal
    (tensor-parallel) group, ORT's group 1.""")

megatron_g = define(
    "megatron_g", ort=(_MS, "MegatronG"), inputs=("input: float",), outputs=("output",),
    attrs={"group_type": 0}, options={"axis_name": None},
    check=lambda input, *, group_type, axis_name: _group([input], group_type, axis_name,
                                                         one_buffer=False),
    reference=lambda input, *, group_type, axis_name: _megatron(
        axis_for(group_type, axis_name), True, varying_axes(input))(input),
    no_matrix=_NO_MATRIX,
    doc="""Megatron's g: all-reduce (sum) forward over the group, identity gradient. (ORT's
    graph transformer sets group_type=1, the horizontal group; the schema default is 0.)""")


def _adasum_pair(a, b):
    """Adasum of two gradients of one tensor: each scaled by 1 - <a,b> / (2 |.|^2); a zero
    vector keeps coefficient 1."""
    acc = jnp.promote_types(a.dtype, jnp.float32)
    a32, b32 = a.astype(acc), b.astype(acc)
    dot, aa, bb = jnp.vdot(a32, b32), jnp.vdot(a32, a32), jnp.vdot(b32, b32)
    ca = jnp.where(aa > 0, 1 - dot / (2 * jnp.where(aa > 0, aa, 1)), 1)
    cb = jnp.where(bb > 0, 1 - dot / (2 * jnp.where(bb > 0, bb, 1)), 1)
    return (ca * a32 + cb * b32).astype(a.dtype)


def _adasum_check(*input, reduce_algo, axis_name):
    if reduce_algo not in (0, 1):
        raise ValueError(f"reduce_algo {reduce_algo} is not supported (0 and 1 are; 2, "
                         "hierarchical, is not)")
    _, world = _group(input, 0, axis_name, one_buffer=False)
    if world & (world - 1):
        raise ValueError(f"the group has {world} ranks; Adasum needs a power of two")


def _adasum(*input, reduce_algo, axis_name):
    axis = axis_for(0, axis_name)
    world = lax.axis_size(axis)
    out = list(input)
    distance = 1
    while distance < world:
        perm = [(r, r ^ distance) for r in range(world)]
        theirs = lax.ppermute(tuple(out), axis, perm)
        lower = (lax.axis_index(axis) & distance) == 0
        # the same operand order on both partners: with FMA contraction the order changes bits
        out = [_adasum_pair(jnp.where(lower, x, y), jnp.where(lower, y, x))
               for x, y in zip(out, theirs)]
        distance *= 2
    return _result(out)


adasum_all_reduce = define(
    "adasum_all_reduce", ort=(_MS, "AdasumAllReduce"), inputs=("*input: float",),
    outputs=("output",), attrs={"reduce_algo": 0}, options={"axis_name": None},
    check=_adasum_check, reference=_adasum, no_matrix=_NO_MATRIX,
    doc="""Adasum (adaptive summation) of each input over the data-parallel group: a butterfly of
    log2(world) pairwise exchanges (ppermute), each combining two ranks' tensors with
    `_adasum_pair`, lower rank first. Needs a power-of-two group. reduce_algo 0/1 (ORT's
    CPU / GPU transports) compute the same math; 2 (hierarchical: NCCL within a node first)
    needs node boundaries jaxops does not know and is refused.""")


__all__ = ["GROUP_AXES", "adasum_all_reduce", "axis_for", "group_axes", "megatron_f",
           "megatron_g", "nccl_all_gather", "nccl_all_reduce", "nccl_reduce_scatter"]
