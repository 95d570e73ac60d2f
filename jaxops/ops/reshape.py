"""Layout ops (com.microsoft): View, PadAndUnflatten, FlattenAndUnpad.

All are XLA code (jaxops.reference.reshape): reshapes and slices cost nothing in XLA, and
the padding ops are one row gather or scatter, which XLA emits as a single memory-bound loop
that fuses with its neighbours. A kernel would add a fusion barrier for no gain.

Shape-like inputs (View's shapes, PadAndUnflatten's unflatten_dims) are int64 tensors in ORT
but decide output shapes in JAX, so they must be static (tuples, lists, numpy or concrete jax
arrays). FlattenAndUnpad's unflatten_dims output is likewise static: a numpy array.
"""
import math

import jax.numpy as jnp

from jaxops.ops._args import check_float, named, static_ints, static_inputs
from jaxops.reference import reshape as ref


@static_inputs('shapes')
def view(input, *shapes):
    """ORT View: output k = the next prod(shapes[k]) elements of the flattened input,
    reshaped to shapes[k]; the sizes must add up to input.size. Returns a tuple."""
    input = jnp.asarray(input)
    with named("view"):
        check_float(input, "input")
        if not shapes:
            raise ValueError("needs at least one shape")
        shapes = [static_ints(s, f"shapes[{k}]") for k, s in enumerate(shapes)]
        if any(d < 0 for s in shapes for d in s):
            raise ValueError(f"shapes must have dims >= 0, got {shapes}")
        total = sum(math.prod(s) for s in shapes)
        if total != input.size:
            raise ValueError(f"shapes hold {total} elements in all, the input {input.size}")
    return ref.view(input, *shapes)


def _check_indices(indices):
    if indices.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {indices.shape}")


@static_inputs('unflatten_dims')
def pad_and_unflatten(input, indices, unflatten_dims):
    """ORT PadAndUnflatten: output [M1, M2, d2..] = zeros with flattened row indices[i] set
    to input[i] (input [d1, d2..], indices [d1], unflatten_dims = [M1, M2], static).

    An index outside [0, M1*M2) (negative included) is dropped; with duplicate indices one
    of the rows wins (ORT: undefined). Gradient: the matching gather (FlattenAndUnpad).
    """
    input, indices = jnp.asarray(input), jnp.asarray(indices)
    with named("pad_and_unflatten"):
        check_float(input, "input")
        _check_indices(indices)
        if input.ndim < 1:
            raise ValueError("input must have rank >= 1, got a scalar")
        if indices.shape[0] != input.shape[0]:
            raise ValueError(f"indices must have one entry per input row: {indices.shape[0]} "
                             f"vs {input.shape[0]}")
        dims = static_ints(unflatten_dims, "unflatten_dims")
        if len(dims) != 2 or min(dims) < 0:
            raise ValueError(f"unflatten_dims must be [M1, M2] with M1, M2 >= 0, got {dims}")
    return ref.pad_and_unflatten(input, indices, dims)


def flatten_and_unpad(input, indices):
    """ORT FlattenAndUnpad: (output, unflatten_dims).

    output[i] = row indices[i] of input [M1, M2, d2..] flattened to [M1*M2, d2..];
    unflatten_dims = [M1, M2], a numpy array of indices' dtype (static). An index outside
    [0, M1*M2) (negative included) gives a zero row. Gradient: the matching scatter.
    """
    input, indices = jnp.asarray(input), jnp.asarray(indices)
    with named("flatten_and_unpad"):
        check_float(input, "input")
        _check_indices(indices)
        if input.ndim < 2:
            raise ValueError(f"input must have rank >= 2, got shape {input.shape}")
    return ref.flatten_and_unpad(input, indices)


__all__ = ["flatten_and_unpad", "pad_and_unflatten", "view"]

ORT_OPS = {
    ("com.microsoft", "View"): view,
    ("com.microsoft", "PadAndUnflatten"): pad_and_unflatten,
    ("com.microsoft", "FlattenAndUnpad"): flatten_and_unpad,
}
