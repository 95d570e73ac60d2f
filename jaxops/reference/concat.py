"""Pure-JAX ConcatTraining / SplitTraining: the test oracle and the JAXOPS_DISABLE fallback."""
import itertools

import jax.numpy as jnp


def concat(*inputs, axis):
    """The inputs joined along `axis` (ConcatTraining's first output)."""
    return jnp.concatenate(inputs, axis=axis)


def split(x, *, sizes, axis):
    """`x` cut along `axis` into consecutive pieces of extents `sizes` (a tuple of ints)."""
    bounds = list(itertools.accumulate(sizes))[:-1]
    return tuple(jnp.split(x, bounds, axis=axis))
