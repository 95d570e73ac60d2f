"""FusedMatMul (com.microsoft contrib): alpha * op(A) @ op(B), which ORT's gradient builder
writes for MatMul gradients where it fuses a transpose. One XLA dot."""
import jax.numpy as jnp

from jaxops.ops import _validate as v


def _prep(x, trans, trans_batch):
    if trans_batch and x.ndim > 2:  # [b0, b1.., M, K]: b0 moves next to the matrix dims
        x = jnp.moveaxis(x, 0, -2)
    return jnp.swapaxes(x, -1, -2) if trans else x


def fused_matmul(A, B, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """ORT FusedMatMul: alpha * op(A) @ op(B) with numpy-style batch broadcasting. transA /
    transB swap the last two dims; transBatchA / transBatchB first move dim 0 of a rank > 2
    operand to the second-to-last place (the Transpose with perm [1, .., r-2, 0, r-1] that
    ORT fuses into the MatMul)."""
    op = "fused_matmul"
    A, B = jnp.asarray(A), jnp.asarray(B)
    dtype = v.floats(op, A=A, B=B)
    v.number(op, "alpha", alpha)
    if A.ndim < 1 or B.ndim < 1:
        v.fail(op, ValueError, f"A and B need rank >= 1, got {A.ndim} and {B.ndim}")
    a, b = _prep(A, transA, transBatchA), _prep(B, transB, transBatchB)
    k_a, k_b = a.shape[-1], b.shape[-2] if b.ndim > 1 else b.shape[0]
    if k_a != k_b:
        v.fail(op, ValueError, f"inner dims differ after the transposes: {a.shape} @ {b.shape}")
    y = jnp.matmul(a, b)
    return y if alpha == 1.0 else (y * jnp.asarray(alpha, y.dtype)).astype(dtype)


__all__ = ["fused_matmul"]

ORT_OPS = {("com.microsoft", "FusedMatMul"): fused_matmul}
