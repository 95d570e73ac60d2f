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


def in_place_accumulator(old_sum, value, update_signal=None):
    """old_sum + cast(value), or old_sum where update_signal is false."""
    new = old_sum + value.astype(old_sum.dtype)
    return new if update_signal is None else jnp.where(_flag(update_signal), new, old_sum)


def in_place_accumulator_v2(accumulation_buffer, value, overwrite_flag=None):
    """(updated_flag [1] bool, buffer + cast(value), or cast(value) where overwrite_flag)."""
    v = value.astype(accumulation_buffer.dtype)
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
