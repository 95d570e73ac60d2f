"""Op(xla_when=...): where XLA's own code is measured faster, an op lowers its reference
instead of calling its kernel (jaxops/_src/op.py). The CUDA rules (concat, split, batch norm
gradient) run on a GPU only; here a probe op routes on the CPU by shape."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops._src.op import Op, batch_at_front
from jaxops.ops import softmax
from jaxops.reference import softmax as ref


def _probe():
    batch = lambda op, args, dims, **p: (op.bind(*batch_at_front(args, dims), **p), 0)
    return Op("routing_probe", shape=softmax._shape, reference=ref.softmax_grad, batch=batch,
              target="jaxops_softmax_grad", ffi_attrs=softmax._ffi_attrs,
              factors=softmax._factors,
              # XLA's code for short rows, the kernel for long ones
              xla_when=lambda platform, dy, y, *, axis, through_end: dy.shape[-1] < 64)


def test_the_route_follows_xla_when(rng):
    op = _probe()
    for width, kernel in ((16, False), (128, True)):
        x = rng.standard_normal((4, width))
        y = jnp.asarray(np.exp(x) / np.exp(x).sum(-1, keepdims=True), jnp.float32)
        dy = jnp.asarray(rng.standard_normal((4, width)), jnp.float32)
        f = jax.jit(lambda a, b: op.bind(a, b, axis=-1, through_end=False))
        hlo = f.lower(dy, y).as_text()
        assert ("jaxops_softmax_grad" in hlo) == kernel, (width, hlo)
        np.testing.assert_allclose(f(dy, y), ref.softmax_grad(dy, y, -1, False),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the CUDA routes need a CUDA device")
def test_cuda_routes_in_the_compiled_program():
    """On the GPU: concat, f16/bf16 split and the batch norm gradient compile to XLA's code,
    the f32 split to its kernel (bench H100 2026-11-24, docs/performance.md)."""
    from jaxops import ops

    def compiled(f, *args):
        return jax.jit(f).lower(*args).compile().as_text()

    xs = [jnp.ones((8, 16), jnp.float32)] * 3
    assert "jaxops_" not in compiled(lambda *x: ops.concat_training(*x, axis=1)[0], *xs)
    for dtype, kernel in ((jnp.float32, True), (jnp.bfloat16, False), (jnp.float16, False)):
        x = jnp.ones((8, 48), dtype)
        text = compiled(lambda x: ops.split_training(x, (16, 32), axis=1), x)
        assert ("jaxops_split" in text) == kernel, dtype
    dy = x = jnp.ones((4, 3, 5, 5), jnp.float32)
    c = jnp.ones((3,), jnp.float32)
    text = compiled(lambda dy, x, s, m, v: ops.batch_normalization_grad(dy, x, s, m, v,
                                                                        epsilon=1e-5),
                    dy, x, c, c, c)
    assert "jaxops_" not in text
