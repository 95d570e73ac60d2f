"""Helpers shared by the ONNX op handlers.

Static values (shapes, axes, indices built from constants) arrive as numpy arrays; a handler
whose operands are all numpy computes with numpy so the result stays static (Reshape's shape
then resolves at import time). Anything else goes through jax.numpy.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from onnx import helper

_STATIC = (np.ndarray, np.generic, int, float, bool)


def is_static(*xs) -> bool:
    """True when every given operand (None ignored) is a concrete numpy/Python value."""
    return all(x is None or isinstance(x, _STATIC) for x in xs)


def xp(*xs):
    """numpy when every operand is static, else jax.numpy."""
    return np if is_static(*xs) else jnp


def np_dtype(onnx_type: int):
    """The numpy (ml_dtypes) dtype of an ONNX TensorProto element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type))


def ints(ctx, x, what):
    """A static integer vector (or None) as a Python list."""
    if x is None:
        return None
    return [int(v) for v in np.asarray(ctx.static(x, what)).reshape(-1)]


def axes_of(ctx, axes_input, axes_attr, what="axes"):
    """Axes given either as an input (newer opsets) or an attribute (older)."""
    if axes_input is not None:
        return ints(ctx, axes_input, what)
    return None if axes_attr is None else list(axes_attr)


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)
