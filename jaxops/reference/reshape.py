"""Pure-JAX View, PadAndUnflatten and FlattenAndUnpad: reshapes, slices, gathers and scatters
that XLA lowers well, so they are also the implementations (jaxops.ops.reshape validates)."""
import math

import jax.numpy as jnp
import numpy as np


def view(input, *shapes):
    """Consecutive pieces of the flattened input, each reshaped to its shape."""
    flat = jnp.ravel(input)
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(jnp.reshape(flat[offset:offset + n], shape))
        offset += n
    return tuple(out)


def _never_wrap(indices, n):
    """Negative indices become out of range (jnp would wrap them from the end)."""
    return jnp.where(indices < 0, n, indices)


def pad_and_unflatten(input, indices, unflatten_dims):
    """zeros [M1*M2, ...] with row indices[i] = input[i], reshaped to [M1, M2, ...].
    Out-of-range (and negative) indices are dropped."""
    m1, m2 = unflatten_dims
    n = m1 * m2
    out = jnp.zeros((n,) + input.shape[1:], input.dtype)
    out = out.at[_never_wrap(indices, n)].set(input, mode="drop")
    return jnp.reshape(out, (m1, m2) + input.shape[1:])


def flatten_and_unpad(input, indices):
    """(rows `indices` of input flattened to [M1*M2, ...], [M1, M2] in indices' dtype).
    Out-of-range (and negative) indices give zero rows."""
    n = input.shape[0] * input.shape[1]
    flat = jnp.reshape(input, (n,) + input.shape[2:])
    rows = jnp.take(flat, _never_wrap(indices, n), axis=0, mode="fill", fill_value=0)
    return rows, np.array(input.shape[:2], np.dtype(indices.dtype))
