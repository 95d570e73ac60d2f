"""DropoutGrad, BitmaskDropoutGrad, SoftmaxDropoutGrad and the forwards BiasDropout,
BitmaskDropout, BiasSoftmaxDropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxops import ops
from jaxops.ops.dropout import bits_to_mask, mask_to_bits
from jaxops.reference import dropout as ref
from helpers import DTYPE_IDS, FLOAT_DTYPES, assert_close, on_cpu_devices


def inputs(rng, shape, dtype):
    dy = jnp.asarray(rng.standard_normal(shape), dtype)
    mask = jnp.asarray(rng.random(shape) > 0.4)
    logits = rng.standard_normal(shape)
    y = np.exp(logits) / np.exp(logits).sum(axis=tuple(range(1, len(shape))), keepdims=True)
    return dy, mask, jnp.asarray(y, dtype)


RATIOS = [None, 0.0, 0.25, np.float16(0.5), np.float64(0.1)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(5, 33), (2, 3, 4), (0, 3)], ids=str)
@pytest.mark.parametrize("ratio", RATIOS, ids=str)
def test_grads_match_reference(rng, dtype, shape, ratio):
    dy, mask, y = inputs(rng, shape, dtype)
    r = 0.5 if ratio is None else float(ratio)
    out = ops.dropout_grad(dy, mask, ratio)
    assert out.dtype == dtype and out.shape == shape
    # in the reference, the ratio-0 rule goes by dy's dtype: compute in f64 after it
    wide = lambda f: f(dy, mask, r) if r == 0 else f(jnp.asarray(dy, jnp.float64), mask, r)
    assert_close(out, wide(ref.dropout_grad), dtype)
    words = mask_to_bits(mask)
    out = ops.bitmask_dropout_grad(dy, words, ratio)
    assert_close(out, wide(lambda d, m, r: ref.bitmask_dropout_grad(d, words, r)), dtype)
    if len(shape) > 1 and r > 0:
        out = ops.softmax_dropout_grad(dy, mask, y, ratio, axis=1)
        assert out.dtype == dtype
        expected = ref.softmax_dropout_grad(jnp.asarray(dy, jnp.float64), mask,
                                            jnp.asarray(y, jnp.float64), r, axis=1)
        assert_close(out, expected, dtype, ulps=16)


def test_ort_quirks(rng):
    dy, mask, _ = inputs(rng, (4, 8), jnp.float32)
    # ratio defaults to 0.5: kept elements doubled
    np.testing.assert_array_equal(ops.dropout_grad(dy, mask), np.where(mask, dy * 2, 0))
    # ratio 0 ignores the mask for f32/f64 but applies it for f16/bf16 (ORT 1.19.2 CPU)
    np.testing.assert_array_equal(ops.dropout_grad(dy, mask, 0.0), dy)
    np.testing.assert_array_equal(ops.bitmask_dropout_grad(dy, mask_to_bits(mask), 0.0), dy)
    for half in (jnp.float16, jnp.bfloat16):
        np.testing.assert_array_equal(ops.dropout_grad(dy.astype(half), mask, 0.0),
                                      np.where(mask, dy.astype(half), 0))
    # training_mode is ignored by the gradient ops
    for flag in (True, False, np.bool_(False), jnp.asarray([False])):
        np.testing.assert_array_equal(ops.dropout_grad(dy, mask, 0.25, flag),
                                      ops.dropout_grad(dy, mask, 0.25))
    # ratio traced under jit: same answers, 0 included
    f = jax.jit(ops.dropout_grad)
    for r in (0.0, 0.25):
        np.testing.assert_allclose(f(dy, mask, jnp.float32(r)), ops.dropout_grad(dy, mask, r))
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"jaxops.ops.dropout_grad: ratio must be in \[0, 1\)"):
            ops.dropout_grad(dy, mask, bad)


def test_bit_layout():
    mask = np.zeros(70, bool)
    mask[[0, 3, 31, 32, 33, 69]] = True
    words = mask_to_bits(jnp.asarray(mask))
    assert words.dtype == jnp.uint32 and words.shape == (3,)
    np.testing.assert_array_equal(words, [1 | 8 | (1 << 31), 1 | 2, 1 << 5])
    np.testing.assert_array_equal(bits_to_mask(words, (7, 10)), mask.reshape(7, 10))
    np.testing.assert_array_equal(ref.unpack_bits(words, (70,)), mask)
    dy = jnp.arange(1.0, 71.0)
    np.testing.assert_array_equal(ops.bitmask_dropout_grad(dy, words, 0.5),
                                  np.where(mask, 2 * np.arange(1.0, 71.0), 0))


@pytest.mark.parametrize("training", [True, False, None], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_bias_dropout(rng, training, dtype):
    x = jnp.asarray(rng.standard_normal((64, 32)), dtype)
    b = jnp.asarray(rng.standard_normal(32), dtype)
    res = jnp.asarray(rng.standard_normal((64, 32)), dtype)
    key = jax.random.key(1)
    out, mask = ops.bias_dropout(x, b, res, 0.25, training, key=key)
    assert out.dtype == dtype and mask.dtype == jnp.bool_ and mask.shape == x.shape
    xb = x.astype(jnp.float32) + b.astype(jnp.float32)
    if training:
        assert abs(float(mask.mean()) - 0.75) < 0.05
        expected = np.where(mask, xb / 0.75, 0) + res.astype(jnp.float32)
        again, mask2 = ops.bias_dropout(x, b, res, 0.25, training, key=key)
        np.testing.assert_array_equal(mask, mask2)  # the key decides the mask
        np.testing.assert_array_equal(out, again)
        _, mask3 = ops.bias_dropout(x, b, res, 0.25, training, key=jax.random.key(2))
        assert not np.array_equal(mask, mask3)
    else:
        assert bool(mask.all())
        expected = xb + res.astype(jnp.float32)
    assert_close(out, expected, dtype)
    # its gradient in data is DropoutGrad on the same mask
    g = jax.grad(lambda x: jnp.sum(ops.bias_dropout(x, b, None, 0.25, training, key=key)[0]
                                   .astype(jnp.float32) * 3))(x)
    expected_g = ops.dropout_grad(jnp.full(x.shape, 3, dtype), mask, 0.25 if training else 0.0)
    assert_close(g, expected_g, dtype)


def test_bitmask_dropout_pairs_with_its_grad(rng):
    x = jnp.asarray(rng.standard_normal((5, 13)), jnp.float32)
    key = jax.random.key(7)
    out, words = ops.bitmask_dropout(x, 0.3, True, key=key)
    assert words.shape == (3,) and words.dtype == jnp.uint32
    keep = bits_to_mask(words, x.shape)
    np.testing.assert_allclose(out, np.where(keep, x / 0.7, 0), rtol=1e-6)
    ct = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    _, vjp = jax.vjp(lambda x: ops.bitmask_dropout(x, 0.3, True, key=key)[0], x)
    np.testing.assert_allclose(vjp(ct)[0], ops.bitmask_dropout_grad(ct, words, 0.3), rtol=1e-6)
    np.testing.assert_array_equal(ops.bias_dropout(x, x[0], None, 0.3, False)[0], x + x[0])
    # a traced training_mode: the same answers as a concrete one
    traced = jax.jit(lambda t: ops.bitmask_dropout(x, 0.3, t, key=key))
    for flag in (True, False):
        jax.tree.map(np.testing.assert_array_equal, traced(jnp.asarray(flag)),
                     ops.bitmask_dropout(x, 0.3, flag, key=key))
    out, words = ops.bitmask_dropout(x)  # training_mode absent: identity, every bit set
    np.testing.assert_array_equal(out, x)
    assert bool(bits_to_mask(words, x.shape).all())
    # the seed attribute stands in for a key
    np.testing.assert_array_equal(ops.bitmask_dropout(x, 0.3, True, seed=3)[1],
                                  ops.bitmask_dropout(x, 0.3, True, key=jax.random.key(3))[1])
    with pytest.raises(TypeError, match="jaxops.ops.bitmask_dropout: needs a JAX PRNG key"):
        ops.bitmask_dropout(x, 0.3, True)


@pytest.mark.parametrize("axis", [1, 2, -1])
def test_bias_softmax_dropout(rng, axis):
    x = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float64)
    bias = jnp.asarray(rng.standard_normal((3, 8)), jnp.float64)
    key = jax.random.key(0)
    out, mask, y = ops.bias_softmax_dropout(x, bias, 0.2, axis=axis, is_inner_broadcast=0,
                                            key=key)
    axes = tuple(range(axis % 3, 3))
    z = (x + bias).reshape(2, -1) if axis == 1 else x + bias
    soft = jax.nn.softmax(z, axis=-1 if axis == 1 else axes).reshape(x.shape)
    np.testing.assert_allclose(y, soft, rtol=1e-12)
    np.testing.assert_allclose(out, np.where(mask, soft / 0.8, 0), rtol=1e-12)
    # SoftmaxDropoutGrad is its vjp in data
    ct = jnp.asarray(rng.standard_normal(x.shape))
    _, vjp = jax.vjp(lambda x: ops.bias_softmax_dropout(x, bias, 0.2, axis=axis,
                                                        is_inner_broadcast=0, key=key)[0], x)
    np.testing.assert_allclose(vjp(ct)[0], ops.softmax_dropout_grad(ct, mask, y, 0.2, axis=axis),
                               rtol=1e-10, atol=1e-12)


# jit, vmap (every in_axes pattern), vmap of grad and check_grads order 2 of every op here, and
# a row-sharded input: tests/test_op_matrix.py. Here a sharded bit mask (many words a shard).
def test_sharded_bit_mask_is_not_gathered(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    dy, m, _ = inputs(rng, (8, 64), jnp.float32)
    w = mask_to_bits(m)
    rows = NamedSharding(mesh, P("x"))
    args = [jax.device_put(dy, rows), jax.device_put(w, rows)]
    jitted = jax.jit(lambda dy, w: ops.bitmask_dropout_grad(dy, w, 0.3))
    hlo = jitted.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    out = jitted(*args)
    np.testing.assert_allclose(out, ops.bitmask_dropout_grad(dy, w, 0.3), rtol=1e-6, atol=1e-7)


def test_bad_input(rng):
    dy, mask, y = inputs(rng, (2, 64), jnp.float32)
    words = mask_to_bits(mask)
    cases = [
        (lambda: ops.dropout_grad(dy.astype(jnp.int32), mask), TypeError, "dropout_grad: dy must"),
        (lambda: ops.dropout_grad(dy, mask.astype(jnp.float32)), TypeError, "mask must be bool"),
        (lambda: ops.dropout_grad(dy, mask[:1]), ValueError, "share one shape"),
        (lambda: ops.dropout_grad(dy, mask, jnp.ones(2) * 0.1), ValueError, "ratio must be a scalar"),
        (lambda: ops.dropout_grad(dy, mask, 1), TypeError, "ratio must be float16"),
        (lambda: ops.dropout_grad(dy, mask, 0.1, 1), TypeError, "training_mode must be bool"),
        (lambda: ops.bitmask_dropout_grad(dy, words.astype(jnp.int32)), TypeError, "uint32"),
        (lambda: ops.bitmask_dropout_grad(dy, words[:3]), ValueError, "4 words"),
        (lambda: ops.softmax_dropout_grad(dy, mask, y, axis=2), ValueError, "out of range"),
        (lambda: ops.softmax_dropout_grad(dy, mask, y.astype(jnp.float64), axis=1), TypeError,
         "share one dtype"),
        (lambda: ops.bias_dropout(dy, jnp.ones(3, jnp.float32), key=jax.random.key(0)), ValueError,
         "bias must be 1-D"),
        (lambda: ops.bias_softmax_dropout(dy, jnp.ones(3, jnp.float32), is_inner_broadcast=0,
                                          key=jax.random.key(0)), ValueError, "does not broadcast"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text) as info:
            call()
        assert "jaxops.ops." in str(info.value)


def test_ort_ops_table():
    ms = "com.microsoft"
    for op_type, fn in [("DropoutGrad", ops.dropout_grad),
                        ("BitmaskDropoutGrad", ops.bitmask_dropout_grad),
                        ("SoftmaxDropoutGrad", ops.softmax_dropout_grad),
                        ("BiasDropout", ops.bias_dropout),
                        ("BitmaskDropout", ops.bitmask_dropout),
                        ("BiasSoftmaxDropout", ops.bias_softmax_dropout)]:
        assert ops.ORT_OPS[(ms, op_type)] is fn
