"""Gradient-control and barrier ops (com.microsoft): ZeroGradient, InPlaceAccumulator,
InPlaceAccumulatorV2, Group, PassThrough.

All are XLA code (jaxops.reference.control), not kernels: they are elementwise or no-ops, so
XLA fuses them into the ops that produce their inputs, which an FFI call (a fusion barrier)
would prevent, and a kernel could at best match XLA's bandwidth.

ORT updates buffers in place; here results are returned. An accumulator's output has its
buffer's shape and dtype, so under `jax.jit(..., donate_argnums=...)` with the buffer donated
XLA writes the result into the donated buffer (no copy); called eagerly, a new array is made.

Accumulating a value whose shape the buffer's shape broadcasts to (e.g. a value of [1,1,4,4]
into a scalar buffer) sums the value over the broadcast dims first. ORT's gradient builder
writes such graphs when a forward op broadcasts a parameter and the builder leaves out the
reduction (a scalar under Where, in BERT exported by torch's dynamo exporter); the sum is the
true gradient. ORT 1.19.2 accepts the value and returns a wrong buffer there (0.0625 where the
gradient is 0.5, measured); a value that does not broadcast that way is an error.
"""
import jax.numpy as jnp
import numpy as np

from jaxops.ops._args import check_flag, check_float, named
from jaxops.reference import control as ref


def zero_gradient(old_gradient, reset_signal):
    """ORT ZeroGradient: zeros shaped like old_gradient. reset_signal (any tensor) only
    orders the op in ORT's graph; JAX orders by data flow, so it is not used. XLA code: a
    constant fill that XLA fuses or folds."""
    old_gradient, reset_signal = jnp.asarray(old_gradient), jnp.asarray(reset_signal)
    with named("zero_gradient"):
        check_float(old_gradient, "old_gradient")
    return ref.zero_gradient(old_gradient, reset_signal)


def _check_accumulate(buffer, value, flag, names):
    check_float(buffer, names[0])
    check_float(value, names[1])
    if buffer.shape != value.shape and not _broadcasts(buffer.shape, value.shape):
        raise ValueError(f"{names[1]} must have {names[0]}'s shape, or one that shape "
                         f"broadcasts to, got {buffer.shape} and {value.shape}")
    if flag is not None:
        check_flag(flag, names[2])


def _broadcasts(shape, to) -> bool:
    try:
        return np.broadcast_shapes(shape, to) == tuple(to)
    except ValueError:
        return False


def in_place_accumulator(old_sum, value, update_signal=None):
    """ORT InPlaceAccumulator: new_sum = old_sum + value (value cast to old_sum's dtype), or
    old_sum unchanged when update_signal (bool, one element) is false. XLA code: one fused
    elementwise add (see the module docstring for in-place use).

    A value of a shape that old_sum's shape broadcasts to is first summed over the broadcast
    dims (module docstring: a deliberate difference from ORT 1.19.2)."""
    old_sum, value = jnp.asarray(old_sum), jnp.asarray(value)
    update_signal = None if update_signal is None else jnp.asarray(update_signal)
    with named("in_place_accumulator"):
        _check_accumulate(old_sum, value, update_signal, ("old_sum", "value", "update_signal"))
    return ref.in_place_accumulator(old_sum, value, update_signal)


def in_place_accumulator_v2(accumulation_buffer, value, overwrite_flag=None):
    """ORT InPlaceAccumulatorV2: (updated_flag, accumulation_buffer_out).

    accumulation_buffer_out = value when overwrite_flag (bool, one element) is true, else
    accumulation_buffer + value (value cast to the buffer's dtype; absent flag: accumulate).
    updated_flag is bool [1], always true (ORT's shape). XLA code: one fused elementwise op;
    donate the buffer under jit to update it in place (module docstring).

    A value of a shape that the buffer's shape broadcasts to is first summed over the
    broadcast dims (module docstring: a deliberate difference from ORT 1.19.2).
    """
    accumulation_buffer, value = jnp.asarray(accumulation_buffer), jnp.asarray(value)
    overwrite_flag = None if overwrite_flag is None else jnp.asarray(overwrite_flag)
    with named("in_place_accumulator_v2"):
        _check_accumulate(accumulation_buffer, value, overwrite_flag,
                          ("accumulation_buffer", "value", "overwrite_flag"))
    return ref.in_place_accumulator_v2(accumulation_buffer, value, overwrite_flag)


def group(*input_tensors):
    """ORT Group: a bool [1] true once every input is computed (ORT 1.19.2's shape; its
    schema says scalar). XLA code: an optimization barrier over the inputs and the flag."""
    input_tensors = [jnp.asarray(x) for x in input_tensors]
    if not input_tensors:
        raise ValueError("jaxops.ops.group: needs at least one input")
    return ref.group(*input_tensors)


def pass_through(*inputs):
    """ORT PassThrough: the inputs unchanged, as a tuple, through an XLA optimization barrier
    (a scheduling barrier, as in ORT's pipeline graphs; no copy)."""
    inputs = [jnp.asarray(x) for x in inputs]
    if not inputs:
        raise ValueError("jaxops.ops.pass_through: needs at least one input")
    return ref.pass_through(*inputs)


__all__ = ["group", "in_place_accumulator", "in_place_accumulator_v2", "pass_through",
           "zero_gradient"]

ORT_OPS = {
    ("com.microsoft", "ZeroGradient"): zero_gradient,
    ("com.microsoft", "InPlaceAccumulator"): in_place_accumulator,
    ("com.microsoft", "InPlaceAccumulatorV2"): in_place_accumulator_v2,
    ("com.microsoft", "Group"): group,
    ("com.microsoft", "PassThrough"): pass_through,
}
