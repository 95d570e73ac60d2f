"""FusedMatMul (com.microsoft contrib): alpha * op(A) @ op(B), which ORT's gradient builder
writes for MatMul gradients where it fuses a transpose. One XLA dot."""
import jax.numpy as jnp

from jaxops._src import rules
from jaxops._src.spec import Matrix, define


def _prep(x, trans, trans_batch):
    if trans_batch and x.ndim > 2:  # [b0, b1.., M, K]: b0 moves next to the matrix dims
        x = jnp.moveaxis(x, 0, -2)
    return jnp.swapaxes(x, -1, -2) if trans else x


def _check(A, B, *, alpha, transA, transB, transBatchA, transBatchB):
    rules.same_dtype(A=A, B=B)
    rules.number("alpha", alpha)
    if A.ndim < 1 or B.ndim < 1:
        raise ValueError(f"A and B need rank >= 1, got {A.ndim} and {B.ndim}")
    a, b = _prep(A, transA, transBatchA), _prep(B, transB, transBatchB)
    k_a, k_b = a.shape[-1], b.shape[-2] if b.ndim > 1 else b.shape[0]
    if k_a != k_b:
        raise ValueError(f"inner dims differ after the transposes: {a.shape} @ {b.shape}")


def _fused_matmul(A, B, *, alpha, transA, transB, transBatchA, transBatchB):
    y = jnp.matmul(_prep(A, transA, transBatchA), _prep(B, transB, transBatchB))
    return y if alpha == 1.0 else (y * jnp.asarray(alpha, y.dtype)).astype(A.dtype)


def _inputs(rng, shape, dtype):
    """A at `shape`, B [3, K] (used transposed): dim 0 of A stays a row dim of Y."""
    return (jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.asarray(rng.standard_normal((3, shape[-1])), dtype))


fused_matmul = define(
    "fused_matmul", ort=("com.microsoft", "FusedMatMul"), inputs=("A: float", "B: float"),
    outputs=("Y",),
    attrs={"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0, "transBatchB": 0},
    check=_check, reference=_fused_matmul,
    doc="""ORT FusedMatMul: alpha * op(A) @ op(B) with numpy-style batch broadcasting. transA /
    transB swap the last two dims; transBatchA / transBatchB first move dim 0 of a rank > 2
    operand to the second-to-last place (the Transpose with perm [1, .., r-2, 0, r-1] that
    ORT fuses into the MatMul).""",
    matrix=Matrix(_inputs, attrs={"alpha": 0.5, "transB": 1}, grad=(0, 1)))

__all__ = ["fused_matmul"]
