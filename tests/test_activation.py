"""Activation gradients, FakeQuantGrad and DivGrad (XLA code) against independent references."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops
from jaxops.ops import activation
from jaxops.reference import activation as ref
from helpers import DTYPE_IDS, FLOAT_DTYPES, assert_close


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape) * 2, dtype)


# forward-output makers for the ops that take Y
_Y = {
    "sigmoid_grad": lambda x: 1 / (1 + np.exp(-x)),
    "tanh_grad": np.tanh,
    "leaky_relu_grad": lambda x: np.where(x > 0, x, 0.01 * x),
}

# (name, op, reference, extra kwargs) for the (dY, X-or-Y) ops
UNARY = [
    ("relu_grad", ops.relu_grad, ref.relu_grad, {}),
    ("sigmoid_grad", ops.sigmoid_grad, ref.sigmoid_grad, {}),
    ("tanh_grad", ops.tanh_grad, ref.tanh_grad, {}),
    ("gelu_grad", ops.gelu_grad, ref.gelu_grad, {}),
    ("fast_gelu_grad", ops.fast_gelu_grad, ref.fast_gelu_grad, {}),
    ("quick_gelu_grad", ops.quick_gelu_grad, ref.quick_gelu_grad, {}),
    ("quick_gelu_grad_alpha", ops.quick_gelu_grad, ref.quick_gelu_grad, {"alpha": 1.1}),
    ("leaky_relu_grad", ops.leaky_relu_grad, ref.leaky_relu_grad, {}),
    ("leaky_relu_grad_alpha", ops.leaky_relu_grad, ref.leaky_relu_grad, {"alpha": 0.2}),
]
UNARY_IDS = [u[0] for u in UNARY]
SHAPES = [(5, 33), (0, 5)]


def unary_inputs(rng, name, shape, dtype):
    # |x| >= 0.05 keeps finite differences off the relu-family kink at 0 (check_grads once
    # straddled it: 4713 against 0.37 for leaky_relu_grad, seed 4229017023)
    x = rng.standard_normal(shape) * 2
    x = np.where(x < 0, -1, 1) * np.maximum(np.abs(x), 0.05)
    y = _Y.get(name.replace("_alpha", ""), lambda x: x)(x)
    return _normal(rng, shape, dtype), jnp.asarray(y, dtype)


def f64(*args):
    return [jnp.asarray(a, jnp.float64) for a in args]


def fast_gelu_scale(name, dtype, dy, x):
    """For f64 fast-GELU ops, the magnitudes the reference (autodiff of tanh-form GELU) adds up:
    it cancels in 1 + t and 1 - t^2 as t -> -1, so its error follows 0.5 |dY| (1 + |t| + (1 +
    t^2) |a x (1 + 3 g x^2)|), not the result (seed 1304074596: 1.3e-14 off a result of 1.8e-7
    at x = -5.49, where the op was exact to 5e-23). None (the result's scale) otherwise."""
    if dtype != jnp.float64 or "fast_gelu" not in name:
        return None
    dy, x = (np.asarray(a, np.float64) for a in (dy, x))
    a, g = np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(a * (x + g * x**3))
    return 0.5 * np.abs(dy) * (1 + np.abs(t) + (1 + t * t) * np.abs(a * x * (1 + 3 * g * x * x)))


@pytest.mark.parametrize("name,op,reference,kw", UNARY, ids=UNARY_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_unary_matches_reference(rng, name, op, reference, kw, dtype, shape):
    dy, x = unary_inputs(rng, name, shape, dtype)
    out = op(dy, x, **kw)
    assert out.dtype == dtype and out.shape == shape
    # the f64 reference, autodiff of tanh-based GELU, cancels in 1 - tanh^2 (f64 worst seen:
    # 31 ulps); f32/f16/bf16 errors are below 1 ulp of the scale (200 seeds)
    ulps = 128 if dtype == jnp.float64 and "gelu" in name else 8
    assert_close(out, reference(*f64(dy, x), **kw), dtype, ulps=ulps,
                 scale=fast_gelu_scale(name, dtype, dy, x))


BIAS = [("bias_gelu_grad_dx", ops.bias_gelu_grad_dx, ref.bias_gelu_grad_dx),
        ("bias_fast_gelu_grad_dx", ops.bias_fast_gelu_grad_dx, ref.bias_fast_gelu_grad_dx)]


@pytest.mark.parametrize("name,op,reference", BIAS, ids=[b[0] for b in BIAS])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(6,), (4, 9), (2, 3, 8)], ids=str)
def test_bias_matches_reference(rng, name, op, reference, dtype, shape):
    dy, x, b = (_normal(rng, s, dtype) for s in (shape, shape, shape[-1:]))
    out = op(dy, x, b)
    assert out.dtype == dtype and out.shape == shape
    # the op forms X + B once in its compute dtype: hand the reference that same sum
    t = jnp.float64 if dtype == jnp.float64 else jnp.float32
    xb = x.astype(t) + b.astype(t)
    ulps = 128 if dtype == jnp.float64 else 8  # the f64 reference cancels in 1 - t^2
    assert_close(out, reference(*f64(dy, xb, jnp.zeros_like(b))), dtype, ulps=ulps,
                 scale=fast_gelu_scale(name, dtype, dy, xb))


def test_exact_points():
    z = jnp.array([-1.0, 0.0, 2.0])
    one = jnp.ones(3)
    np.testing.assert_array_equal(ops.relu_grad(one, z), [0, 0, 1])  # 0 at X == 0
    np.testing.assert_allclose(ops.leaky_relu_grad(one, z), [0.01, 0.01, 1], rtol=1e-6)
    np.testing.assert_allclose(ops.leaky_relu_grad(one, z, alpha=0.5), [0.5, 0.5, 1])
    np.testing.assert_allclose(ops.gelu_grad(one, jnp.zeros(3)), 0.5)
    np.testing.assert_allclose(ops.fast_gelu_grad(one, jnp.zeros(3)), 0.5)
    np.testing.assert_allclose(ops.quick_gelu_grad(one, jnp.zeros(3)), 0.5)
    assert ops.quick_gelu_grad.spec.attrs == {"alpha": 1.702}
    assert ops.leaky_relu_grad.spec.attrs == {"alpha": 0.01}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_fake_quant_grad(rng, dtype):
    dy = _normal(rng, (5, 7), dtype)
    mask = jnp.asarray(rng.random((5, 7)) > 0.3)
    out = ops.fake_quant_grad(dy, mask)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, ref.fake_quant_grad(dy, mask))
    np.testing.assert_array_equal(out, np.where(mask, dy, 0))


DIV_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 4), (3, 1)), ((2, 1, 4), (3, 1)),
              ((4,), (2, 3, 4)), ((1,), (5, 2)), ((), (3,)), ((2, 3), ())]


def div_inputs(rng, a_shape, b_shape, dtype):
    full = np.broadcast_shapes(a_shape, b_shape)
    a = _normal(rng, a_shape, dtype)
    b = jnp.asarray((rng.random(b_shape) + 0.5) * rng.choice([-1, 1], b_shape), dtype)
    return _normal(rng, full, dtype), a, b


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("a_shape,b_shape", DIV_SHAPES, ids=str)
def test_div_grad(rng, dtype, a_shape, b_shape):
    dy, a, b = div_inputs(rng, a_shape, b_shape, dtype)
    da, db = ops.div_grad(dy, a, b)
    ea, eb = ref.div_grad(*f64(dy, a, b))
    assert da.shape == a_shape and db.shape == b_shape and da.dtype == db.dtype == dtype
    assert_close(da, ea, dtype, ulps=16)
    # dB sums -dY A / B^2 over the broadcast dims: its terms' magnitudes set the scale where
    # they cancel (seed 1605225950: one entry 4e-7 off -0.018, a 16-ulp relative bound 7e-8)
    terms = np.abs(ref.div_grad(*f64(jnp.abs(dy), jnp.abs(a), jnp.abs(b)))[1])
    assert_close(db, eb, dtype, ulps=16, scale=terms)


def test_div_grad_outputs_keyword(rng):
    dy, a, b = div_inputs(rng, (3, 4), (4,), jnp.float32)
    da, db = ops.div_grad(dy, a, b, outputs=(True, False))
    assert db is None and da.shape == (3, 4)
    da, db = ops.div_grad(dy, a, b, outputs=(False, True))
    assert da is None and db.shape == (4,)
    # an unwanted output is not computed: its math is absent from the jaxpr
    jaxpr = str(jax.make_jaxpr(lambda *x: ops.div_grad(*x, outputs=(True, False)))(dy, a, b))
    assert "mul" not in jaxpr and "neg" not in jaxpr


# the family's ops; tests/test_op_matrix.py runs jit, vmap, vmap of grad, check_grads order 2
# and sharding for each from its spec's matrix row
FAMILY = activation.__all__


@pytest.mark.parametrize("name", FAMILY)
def test_bad_input(rng, name):
    """Dtype and shape mismatches name the op, eagerly and under jit."""
    spec = ops.SPECS[name]
    fn = functools.partial(getattr(ops, name), **spec.matrix.attrs)
    good = spec.matrix.make(rng, (2, 4), jnp.float32)
    cases = [(0, jnp.ones((2, 4), jnp.int32), TypeError, "must be float16"),
             (0, jnp.ones((2, 4), jnp.float64), TypeError, "share one dtype"),
             (0, jnp.ones((3, 4), jnp.float32), ValueError, "shape")]
    if name == "fake_quant_grad":
        cases[1] = (1, jnp.ones((2, 4), jnp.float32), TypeError, "must be bool")
    for i, bad, error, text in cases:
        args = list(good)
        args[i] = bad
        for call in (fn, jax.jit(fn)):
            with pytest.raises(error, match=text) as info:
                call(*args)
            assert f"jaxops.ops.{name}: " in str(info.value)


def test_bad_attributes():
    one = jnp.ones(3)
    with pytest.raises(TypeError, match="jaxops.ops.quick_gelu_grad: alpha"):
        ops.quick_gelu_grad(one, one, alpha="1")
    with pytest.raises(ValueError, match="jaxops.ops.bias_gelu_grad_dx: B must be 1-D"):
        ops.bias_gelu_grad_dx(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="jaxops.ops.div_grad: .* do not broadcast"):
        ops.div_grad(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2,)))
    with pytest.raises(ValueError, match="jaxops.ops.div_grad: dY must have"):
        ops.div_grad(jnp.ones((3,)), jnp.ones((2, 3)), jnp.ones((3,)))
    with pytest.raises(TypeError, match="jaxops.ops.div_grad: outputs must be 2 bools"):
        ops.div_grad(one, one, one, outputs=(True,))


def test_ort_ops_table():
    ms = "com.microsoft"
    for op_type, fn in [("ReluGrad", ops.relu_grad), ("SigmoidGrad", ops.sigmoid_grad),
                        ("TanhGrad", ops.tanh_grad), ("GeluGrad", ops.gelu_grad),
                        ("FastGeluGrad", ops.fast_gelu_grad),
                        ("QuickGeluGrad", ops.quick_gelu_grad),
                        ("LeakyReluGrad", ops.leaky_relu_grad),
                        ("BiasGeluGrad_dX", ops.bias_gelu_grad_dx),
                        ("BiasFastGeluGrad_dX", ops.bias_fast_gelu_grad_dx),
                        ("FakeQuantGrad", ops.fake_quant_grad), ("DivGrad", ops.div_grad)]:
        assert ops.ORT_OPS[(ms, op_type)] is fn
