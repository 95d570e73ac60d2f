"""BroadcastGradientArgs (com.microsoft): the axes a broadcasting op's input gradients are
summed over. A shape computation: it runs on concrete shapes at trace time, as every shape
in a jitted JAX program is static."""
import numpy as np

from jaxops._src.spec import define


def _axes(a, b):
    rank = max(len(a), len(b))
    a_axes, b_axes = [], []
    for i in reversed(range(rank)):
        da = a[i - rank + len(a)] if i - rank + len(a) >= 0 else 1
        db = b[i - rank + len(b)] if i - rank + len(b) >= 0 else 1
        if da == db:
            continue
        if da == 1:
            a_axes.append(i)
        elif db == 1:
            b_axes.append(i)
        else:
            raise ValueError(f"shapes {list(a)} and {list(b)} do not broadcast "
                             f"(axis {i}: {da} vs {db})")
    return np.asarray(a_axes, np.int64), np.asarray(b_axes, np.int64)


def _check(a_shape, b_shape):
    for label, shape in (("a_shape", a_shape), ("b_shape", b_shape)):
        if any(d < 0 for d in shape):
            raise ValueError(f"{label} has a negative dim: {list(shape)}")
    _axes(a_shape, b_shape)  # shapes that do not broadcast: refused here, naming the op


broadcast_gradient_args = define(
    "broadcast_gradient_args", ort=("com.microsoft", "BroadcastGradientArgs"),
    inputs=("a_shape: static", "b_shape: static"), outputs=("a_axes", "b_axes"),
    check=_check, reference=_axes,
    doc="""ORT BroadcastGradientArgs: (a_axes, b_axes), int64, the output axes over which the
    gradients of A and B must be summed under numpy broadcasting. As ORT, axes run from the
    last to the first, an axis is listed for the operand whose dim is 1 (or missing) where
    the other's is not, and equal dims (1 and 1 included) list nothing.

    a_shape and b_shape are static (tuples, lists, numpy or concrete jax arrays); the axes
    come back as numpy arrays, static too.""",
    no_matrix="a host shape computation: static int inputs and numpy outputs, nothing to "
              "differentiate, batch or shard")

__all__ = ["broadcast_gradient_args"]
