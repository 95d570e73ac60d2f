"""jaxops/_src/flash_attention.py: the float32 flash attention kernels, run here by Pallas'
interpreter (any backend) against the written-out formula; on a GPU the compiled kernels are
checked by tests/test_fused_attention.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops._src import flash_attention as fa

needs_pallas = pytest.mark.skipif(fa.plgpu is None, reason="this jax has no Pallas Triton")


def _reference(q, k, v, scale):
    s = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * scale
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v, precision="highest")


@needs_pallas
@pytest.mark.parametrize("shape,scale", [((2, 128, 3, 32), 0.3), ((1, 192, 2, 16), 1.0),
                                         ((1, 256, 1, 64), 0.125)])
def test_forward_and_gradients_match_the_formula(shape, scale):
    keys = jax.random.split(jax.random.key(sum(shape)), 4)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    with jax.default_matmul_precision("float32"):
        out, vjp = jax.vjp(lambda *a: fa.flash_attention(*a, scale, True), q, k, v)
        grads = vjp(d_out)
        want, want_vjp = jax.vjp(lambda *a: _reference(*a, scale), q, k, v)
        want_grads = want_vjp(d_out)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    for got, ref in zip(grads, want_grads):
        np.testing.assert_allclose(got, ref, atol=5e-5, rtol=5e-5)


def test_applies_only_to_float32_on_a_gpu_at_tileable_shapes():
    x = jnp.zeros((1, 128, 2, 64), jnp.float32)
    on_gpu = jax.default_backend() == "gpu"
    assert fa.applies(x, x, x) == on_gpu
    assert not fa.applies(x.astype(jnp.bfloat16), x, x)
    odd = jnp.zeros((1, 96, 2, 64), jnp.float32)  # T not a multiple of 64
    assert not fa.applies(odd, odd, odd)
    wide = jnp.zeros((1, 128, 2, 96), jnp.float32)  # head size not a power of 2
    assert not fa.applies(wide, wide, wide)


@needs_pallas
def test_packed_operand_matches_three_operands():
    shape = (2, 128, 3, 32)
    keys = jax.random.split(jax.random.key(7), 2)
    qkv = jax.random.normal(keys[0], (2, 128, 3, 3, 32), jnp.float32)
    d_out = jax.random.normal(keys[1], shape, jnp.float32)
    with jax.default_matmul_precision("float32"):
        out, vjp = jax.vjp(lambda x: fa.flash_attention_packed(x, 0.2, True), qkv)
        (grad,) = vjp(d_out)
        want, want_vjp = jax.vjp(
            lambda x: _reference(x[:, :, 0], x[:, :, 1], x[:, :, 2], 0.2), qkv)
        (want_grad,) = want_vjp(d_out)
    assert grad.shape == qkv.shape
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(grad, want_grad, atol=5e-5, rtol=5e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu" or fa.plgpu is None,
                    reason="the compiled kernels run on a GPU")
@pytest.mark.parametrize("packed", [False, True], ids=["qkv", "packed"])
def test_gradients_are_the_same_bits_every_run(packed):
    """No atomics in the backward (dQ has its own pass): two runs give identical gradients."""
    keys = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(keys[0], (4, 512, 3, 4, 64), jnp.float32)
    d_out = jax.random.normal(keys[1], (4, 512, 4, 64), jnp.float32)
    if packed:
        f = lambda x: fa.flash_attention_packed(x, 0.125)
    else:
        f = lambda x: fa.flash_attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], 0.125)
    grad = jax.jit(lambda x, d: jax.vjp(f, x)[1](d)[0])
    first = np.asarray(grad(x, d_out))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(grad(x, d_out)), first)
