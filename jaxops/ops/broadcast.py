"""BroadcastGradientArgs (com.microsoft): the axes a broadcasting op's input gradients are
summed over. A shape computation: it runs on concrete shapes at trace time, as every shape
in a jitted JAX program is static."""
import numpy as np

from jaxops.ops import _validate as v
from jaxops.ops._args import static_inputs


def _shape(label, s):
    try:
        a = np.asarray(s)
    except Exception:  # noqa: BLE001 - a tracer cannot become a numpy array
        a = None
    if a is None or a.dtype == object or a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        v.fail("broadcast_gradient_args", TypeError,
               f"{label} must be a concrete 1-D integer shape, got {s!r}")
    if (a < 0).any():
        v.fail("broadcast_gradient_args", ValueError, f"{label} has a negative dim: {a}")
    return [int(d) for d in a]


@static_inputs('a_shape', 'b_shape')
def broadcast_gradient_args(a_shape, b_shape):
    """ORT BroadcastGradientArgs: (a_axes, b_axes), int64, the output axes over which the
    gradients of A and B must be summed under numpy broadcasting. As ORT, axes run from the
    last to the first, an axis is listed for the operand whose dim is 1 (or missing) where
    the other's is not, and equal dims (1 and 1 included) list nothing."""
    a, b = _shape("a_shape", a_shape), _shape("b_shape", b_shape)
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
            v.fail("broadcast_gradient_args", ValueError,
                   f"shapes {a} and {b} do not broadcast (axis {i}: {da} vs {db})")
    return np.asarray(a_axes, np.int64), np.asarray(b_axes, np.int64)


__all__ = ["broadcast_gradient_args"]

ORT_OPS = {("com.microsoft", "BroadcastGradientArgs"): broadcast_gradient_args}
