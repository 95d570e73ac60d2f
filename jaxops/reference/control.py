"""Pure-JAX gradient-control ops: ZeroGradient, InPlaceAccumulator(V2), Group, PassThrough.

These are also the implementations (jaxops.ops.control validates and calls them): they are
elementwise or no-ops, which XLA fuses into their neighbours better than any kernel could.
"""
import jax
import jax.numpy as jnp


def zero_gradient(old_gradient, reset_signal):
    """zeros like old_gradient; reset_signal is only an ordering dependency in ORT."""
    del reset_signal
    return jnp.zeros_like(old_gradient)


def _flag(flag):
    """ORT reads the first element of a bool tensor of one element."""
    return jnp.reshape(flag, ())


def sum_to_shape(value, shape):
    """`value` summed over the dims along which `shape` was broadcast to value's shape: the
    gradient of a value of `shape` that the forward graph broadcast. ORT's gradient builder
    sometimes leaves that sum out (a scalar broadcast by Where); the caller checks that `shape`
    broadcasts to value's shape."""
    shape = tuple(shape)
    if value.shape == shape:
        return value
    lead = value.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and value.shape[lead + i] != 1)
    return jnp.sum(value, axis=axes).reshape(shape)


def in_place_accumulator(old_sum, value, update_signal=None):
    """old_sum + cast(value), or old_sum where update_signal is false (value summed to
    old_sum's shape where old_sum's shape broadcasts to it)."""
    value = sum_to_shape(value, old_sum.shape)
    new = old_sum + value.astype(old_sum.dtype)
    return new if update_signal is None else jnp.where(_flag(update_signal), new, old_sum)


def in_place_accumulator_v2(accumulation_buffer, value, overwrite_flag=None):
    """(updated_flag [1] bool, buffer + cast(value), or cast(value) where overwrite_flag;
    value summed to the buffer's shape where that broadcasts to it)."""
    v = sum_to_shape(value, accumulation_buffer.shape).astype(accumulation_buffer.dtype)
    out = accumulation_buffer + v
    if overwrite_flag is not None:
        out = jnp.where(_flag(overwrite_flag), v, out)
    return jnp.ones((1,), jnp.bool_), out


def group(*input_tensors):
    """[True] once every input is computed: the barrier ties the flag to the inputs."""
    _, done = jax.lax.optimization_barrier((input_tensors, jnp.ones((1,), jnp.bool_)))
    return done


def pass_through(*inputs):
    """The inputs, through an optimization barrier (no copy)."""
    return tuple(jax.lax.optimization_barrier(tuple(inputs)))
