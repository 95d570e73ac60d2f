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

GROUP_AXES = {0: "data", 1: "model"}
_axes = contextvars.ContextVar("jaxops_group_axes", default=None)
_FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_SLICE = 32  # ORT pads the fused buffer to a multiple of world_size * 32 elements


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


def _check(op, inputs, same_dtype=True):
    if not inputs:
        raise ValueError(f"jaxops.ops.{op}: needs at least one input")
    inputs = [jnp.asarray(x) for x in inputs]
    for x in inputs:
        if x.dtype not in _FLOATS:
            raise TypeError(f"jaxops.ops.{op}: inputs must be float16, bfloat16, float32 or "
                            f"float64, got {x.dtype}")
    if same_dtype and len({x.dtype for x in inputs}) > 1:
        raise TypeError(f"jaxops.ops.{op}: ORT packs the inputs into one buffer of one type; "
                        f"got {sorted({str(x.dtype) for x in inputs})}")
    return inputs


def _axis_size(op, axis):
    try:
        return lax.axis_size(axis)
    except NameError as e:
        raise ValueError(f"jaxops.ops.{op}: mesh axis {axis!r} is not bound; call it inside "
                         "jax.shard_map (or pmap) over a mesh with that axis") from e


def _result(outputs):
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def nccl_all_reduce(*inputs, group_type=0, axis_name=None):
    """Sum of each input over the group (no averaging). One all-reduce for all inputs."""
    inputs = _check("nccl_all_reduce", inputs, same_dtype=False)
    axis = axis_for(group_type, axis_name)
    _axis_size("nccl_all_reduce", axis)
    return _result(list(lax.psum(tuple(inputs), axis)))


def _layout(op, inputs, world):
    """ORT's fused layout: the inputs back to back, padded to world * 32 * k elements; rank r
    owns elements [r * per_rank, (r + 1) * per_rank); a tensor belongs to the rank where it
    starts and must end there too."""
    sizes = [int(x.size) for x in inputs]
    total = sum(sizes)
    per_rank = max(1, math.ceil(total / (world * _SLICE))) * _SLICE
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for i, (s, n) in enumerate(zip(starts, sizes)):
        owner = s // per_rank
        if n and (s + n - 1) // per_rank != owner:
            raise ValueError(f"jaxops.ops.{op}: input {i} ({n} elements at offset {s}) straddles "
                             f"the ranges of ranks {owner} and {(s + n - 1) // per_rank} "
                             f"({per_rank} elements each); ORT requires each tensor to lie in "
                             "one rank's range")
    buffer = jnp.concatenate([x.ravel() for x in inputs]
                             + [jnp.zeros(world * per_rank - total, inputs[0].dtype)])
    return buffer, per_rank, starts, sizes


def _unpack(buffer, inputs, starts, sizes):
    return [buffer[s:s + n].reshape(x.shape) for x, s, n in zip(inputs, starts, sizes)]


def nccl_all_gather(*inputs, group_type=0, axis_name=None):
    """Every output i takes input i's value from the rank whose range holds tensor i (ORT's
    ZeRO layout, see `_layout`): one all-gather of the packed buffer."""
    inputs = _check("nccl_all_gather", inputs)
    axis = axis_for(group_type, axis_name)
    world = _axis_size("nccl_all_gather", axis)
    buffer, per_rank, starts, sizes = _layout("nccl_all_gather", inputs, world)
    mine = lax.dynamic_slice_in_dim(buffer, lax.axis_index(axis) * per_rank, per_rank)
    full = lax.all_gather(mine, axis, tiled=True)
    return _result(_unpack(full, inputs, starts, sizes))


def nccl_reduce_scatter(*inputs, group_type=0, axis_name=None):
    """Tensors in this rank's range of the packed buffer receive their sum over the group;
    every other output is a copy of its input (ORT's semantics): one reduce-scatter."""
    inputs = _check("nccl_reduce_scatter", inputs)
    axis = axis_for(group_type, axis_name)
    world = _axis_size("nccl_reduce_scatter", axis)
    buffer, per_rank, starts, sizes = _layout("nccl_reduce_scatter", inputs, world)
    summed = lax.psum_scatter(buffer, axis, tiled=True)
    full = lax.dynamic_update_slice_in_dim(buffer, summed, lax.axis_index(axis) * per_rank, 0)
    return _result(_unpack(full, inputs, starts, sizes))


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


def megatron_f(input, *, axis_name=None):
    """Megatron's f: identity forward, all-reduce (sum) of the gradient over the horizontal
    (tensor-parallel) group, ORT's group 1."""
    (input,) = _check("megatron_f", [input])
    axis = axis_for(1, axis_name)
    _axis_size("megatron_f", axis)
    return _megatron(axis, False, varying_axes(input))(input)


def megatron_g(input, *, group_type=0, axis_name=None):
    """Megatron's g: all-reduce (sum) forward over the group, identity gradient. (ORT's
    graph transformer sets group_type=1, the horizontal group; the schema default is 0.)"""
    (input,) = _check("megatron_g", [input])
    axis = axis_for(group_type, axis_name)
    _axis_size("megatron_g", axis)
    return _megatron(axis, True, varying_axes(input))(input)


def _adasum_pair(a, b):
    """Adasum of two gradients of one tensor: each scaled by 1 - <a,b> / (2 |.|^2); a zero
    vector keeps coefficient 1."""
    acc = jnp.promote_types(a.dtype, jnp.float32)
    a32, b32 = a.astype(acc), b.astype(acc)
    dot, aa, bb = jnp.vdot(a32, b32), jnp.vdot(a32, a32), jnp.vdot(b32, b32)
    ca = jnp.where(aa > 0, 1 - dot / (2 * jnp.where(aa > 0, aa, 1)), 1)
    cb = jnp.where(bb > 0, 1 - dot / (2 * jnp.where(bb > 0, bb, 1)), 1)
    return (ca * a32 + cb * b32).astype(a.dtype)


def adasum_all_reduce(*inputs, reduce_algo=0, axis_name=None):
    """Adasum (adaptive summation) of each input over the data-parallel group: a butterfly of
    log2(world) pairwise exchanges (ppermute), each combining two ranks' tensors with
    `_adasum_pair`, lower rank first. Needs a power-of-two group. reduce_algo 0/1 (ORT's
    CPU / GPU transports) compute the same math; 2 (hierarchical: NCCL within a node first)
    needs node boundaries jaxops does not know and is refused."""
    inputs = _check("adasum_all_reduce", inputs, same_dtype=False)
    if reduce_algo not in (0, 1):
        raise ValueError(f"jaxops.ops.adasum_all_reduce: reduce_algo {reduce_algo} is not "
                         "supported (0 and 1 are; 2, hierarchical, is not)")
    axis = axis_for(0, axis_name)
    world = _axis_size("adasum_all_reduce", axis)
    if world & (world - 1):
        raise ValueError(f"jaxops.ops.adasum_all_reduce: the group has {world} ranks; "
                         "Adasum needs a power of two")
    out = list(inputs)
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


__all__ = ["GROUP_AXES", "adasum_all_reduce", "axis_for", "group_axes", "megatron_f",
           "megatron_g", "nccl_all_gather", "nccl_all_reduce", "nccl_reduce_scatter"]

_MS = "com.microsoft"
ORT_OPS = {
    (_MS, "NcclAllReduce"): nccl_all_reduce,
    (_MS, "NcclAllGather"): nccl_all_gather,
    (_MS, "NcclReduceScatter"): nccl_reduce_scatter,
    (_MS, "MegatronF"): megatron_f,
    (_MS, "MegatronG"): megatron_g,
    (_MS, "AdasumAllReduce"): adasum_all_reduce,
}
