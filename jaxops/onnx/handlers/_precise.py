"""Computing a handler's float32 arithmetic in 64 bits, whether or not jax's x64 is on.

ONNX's reference results come from numpy, whose float32 division is correctly rounded and
whose FFTs run in float64. XLA's float32 division is not correctly rounded on CPU (a quotient
an ulp off rounds the other way at .5: DynamicQuantizeLinear) and a float32 FFT is ~1e-6 off
where the exact value is 0 (DFT). `in_float64(f)` runs f on float64/complex128 copies of its
operands (with `jax.enable_x64` for the call, so also when x64 is off) and casts the result to
the dtype f gives on the operands as they are: float32 in, float32 out.

The derivative is f's own, computed in the operands' precision: a custom_jvp whose tangent is
`jax.jvp(f, ...)` at the original dtypes, so forward and reverse mode, vmap and higher orders
work as for f (a transpose of the 64-bit ops, traced after the x64 context has closed, would
not).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _widen(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return x.astype(jnp.complex128)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.float64)
    return x


def in_float64(f):
    """f(*arrays) computed in float64/complex128, its result in f's usual dtypes."""

    @jax.custom_jvp
    def wide(*args):
        types = jax.eval_shape(f, *args)
        with jax.enable_x64(True):
            out = f(*map(_widen, args))
        return jax.tree.map(lambda o, t: o.astype(t.dtype), out, types)

    @wide.defjvp
    def _(primals, tangents):
        return wide(*primals), jax.jvp(f, primals, tangents)[1]

    return wide
