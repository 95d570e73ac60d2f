"""Layout ops (com.microsoft): View, PadAndUnflatten, FlattenAndUnpad.

All are XLA code (jaxops.reference.reshape): reshapes and slices cost nothing in XLA, and
the padding ops are one row gather or scatter, which XLA emits as a single memory-bound loop
that fuses with its neighbours. A kernel would add a fusion barrier for no gain, so the specs
have none (`JAXOPS_DISABLE` changes nothing).

Shape-like inputs (View's shapes, PadAndUnflatten's unflatten_dims) are int64 tensors in ORT
but decide output shapes in JAX, so they must be static (tuples, lists, numpy or concrete jax
arrays). FlattenAndUnpad's unflatten_dims output is likewise static: a numpy array.
"""
import math

import jax.numpy as jnp

from jaxops._src.spec import Matrix, define
from jaxops.reference import reshape as ref

_MS = "com.microsoft"


def _check_view(input, *shapes):
    if not shapes:
        raise ValueError("needs at least one shape")
    if any(d < 0 for s in shapes for d in s):
        raise ValueError(f"shapes must have dims >= 0, got {list(shapes)}")
    total = sum(math.prod(s) for s in shapes)
    if total != input.size:
        raise ValueError(f"shapes hold {total} elements in all, the input {input.size}")


view = define(
    "view", ort=(_MS, "View"), inputs=("input: float", "*shapes: static"), outputs=("*outputs",),
    check=_check_view, reference=ref.view,
    doc="""ORT View: output k = the next prod(shapes[k]) elements of the flattened input,
    reshaped to shapes[k]; the sizes must add up to input.size. Returns a tuple.""",
    no_matrix="its shapes are variadic static inputs, which a matrix row cannot give (vmap "
              "stacks the positional inputs, Matrix.attrs are keywords); tests/test_reshape.py "
              "checks its vmap and gradient")


def _check_indices(indices):
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {indices.shape}")


def _check_pad(input, indices, unflatten_dims):
    _check_indices(indices)
    if input.ndim < 1:
        raise ValueError("input must have rank >= 1, got a scalar")
    if indices.shape[0] != input.shape[0]:
        raise ValueError(f"indices must have one entry per input row: {indices.shape[0]} "
                         f"vs {input.shape[0]}")
    if len(unflatten_dims) != 2 or min(unflatten_dims) < 0:
        raise ValueError(f"unflatten_dims must be [M1, M2] with M1, M2 >= 0, "
                         f"got {unflatten_dims}")


_MOVES_ROWS = ("rows go to (or come from) positions the indices choose, so they cross shards: "
               "dim 0 of the output cannot follow dim 0 of the input without communication")
_PAD_DIMS = (4, 4)  # the matrix rows' [M1, M2]: room for the 8 rows of the sharded check


def _pad_inputs(rng, shape, dtype):
    """shape[0] rows scattered to distinct positions of a [4, 4] grid."""
    rows = rng.choice(math.prod(_PAD_DIMS), size=shape[0], replace=False)
    return jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rows, jnp.int32)


pad_and_unflatten = define(
    "pad_and_unflatten", ort=(_MS, "PadAndUnflatten"),
    inputs=("input: float", "indices: index", "unflatten_dims: static"), outputs=("output",),
    check=_check_pad, reference=ref.pad_and_unflatten,
    doc="""ORT PadAndUnflatten: output [M1, M2, d2..] = zeros with flattened row indices[i] set
    to input[i] (input [d1, d2..], indices [d1], unflatten_dims = [M1, M2], static).

    An index outside [0, M1*M2) (negative included) is dropped; with duplicate indices one
    of the rows wins (ORT: undefined). Gradient: the matching gather (FlattenAndUnpad).
    """,
    matrix=Matrix(_pad_inputs, attrs={"unflatten_dims": _PAD_DIMS}, grad=(0,), shard=False,
                  skip=_MOVES_ROWS))


def _check_unpad(input, indices):
    _check_indices(indices)
    if input.ndim < 2:
        raise ValueError(f"input must have rank >= 2, got shape {input.shape}")


def _unpad_inputs(rng, shape, dtype):
    """input [M1, M2, 2] at shape = (M1, M2); shape[0] distinct rows of it, read back."""
    rows = rng.choice(math.prod(shape), size=shape[0], replace=False)
    return (jnp.asarray(rng.standard_normal(tuple(shape) + (2,)), dtype),
            jnp.asarray(rows, jnp.int32))


flatten_and_unpad = define(
    "flatten_and_unpad", ort=(_MS, "FlattenAndUnpad"), inputs=("input: float", "indices: index"),
    outputs=("output", "unflatten_dims"), check=_check_unpad, reference=ref.flatten_and_unpad,
    doc="""ORT FlattenAndUnpad: (output, unflatten_dims).

    output[i] = row indices[i] of input [M1, M2, d2..] flattened to [M1*M2, d2..];
    unflatten_dims = [M1, M2], a numpy array of indices' dtype (static). An index outside
    [0, M1*M2) (negative included) gives a zero row. Gradient: the matching scatter.
    """,
    # no grad in the row: check_grads cannot take the int unflatten_dims output (its tangent
    # is float0); tests/test_reshape.py checks the gradient of `output` to order 2
    matrix=Matrix(_unpad_inputs, shard=False, skip=_MOVES_ROWS))

__all__ = ["flatten_and_unpad", "pad_and_unflatten", "view"]
