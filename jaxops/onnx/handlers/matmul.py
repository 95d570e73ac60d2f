"""Matrix products: MatMul, Gemm, Einsum, Det, and the integer/quantized variants."""
from __future__ import annotations

import jax.numpy as jnp

from ..registry import handler
from ._util import xp


@handler("MatMul")
def matmul(ctx, a, b):
    return xp(a, b).matmul(a, b)


@handler("Gemm")
def gemm(ctx, A, B, C=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, **_legacy):
    a = A.T if transA else A
    b = B.T if transB else B
    y = jnp.matmul(a, b)
    if alpha != 1.0:
        y = y * jnp.asarray(alpha, y.dtype)
    if C is not None:
        y = y + (C * jnp.asarray(beta, C.dtype) if beta != 1.0 else C)
    return y.astype(A.dtype)


@handler("Einsum", since=12)
def einsum(ctx, *xs, equation):
    return jnp.einsum(equation.replace(" ", ""), *xs)


@handler("Det", since=11)
def det(ctx, x):
    return jnp.linalg.det(x)


def _centered(x, zp):
    x = jnp.asarray(x).astype(jnp.int32)
    return x if zp is None else x - jnp.asarray(zp).astype(jnp.int32)


@handler("MatMulInteger", since=10)
def matmul_integer(ctx, a, b, a_zero_point=None, b_zero_point=None):
    za = None if a_zero_point is None else (a_zero_point.reshape(-1, 1) if a_zero_point.ndim == 1 and a_zero_point.size > 1 else a_zero_point)
    return jnp.matmul(_centered(a, za), _centered(b, b_zero_point), preferred_element_type=jnp.int32)
