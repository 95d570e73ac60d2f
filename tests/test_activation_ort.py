"""Activation gradients, FakeQuantGrad and DivGrad against onnxruntime-training 1.19.2 (CPU)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops
from jaxops.ops.activation import _sum_to
from helpers import assert_close

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")

F32, F16, F64 = np.float32, np.float16, np.float64
# (ORT op, jaxops function, second input is the forward output?, attrs, dtypes ORT runs on CPU)
UNARY = [
    ("ReluGrad", ops.relu_grad, False, {}, [F32, F16]),
    ("SigmoidGrad", ops.sigmoid_grad, True, {}, [F32, F16, F64]),
    ("TanhGrad", ops.tanh_grad, True, {}, [F32, F16, F64]),
    ("GeluGrad", ops.gelu_grad, False, {}, [F32, F16]),
    ("FastGeluGrad", ops.fast_gelu_grad, False, {}, [F32, F16, F64]),
    ("QuickGeluGrad", ops.quick_gelu_grad, False, {}, [F32, F16]),
    ("QuickGeluGrad", ops.quick_gelu_grad, False, {"alpha": 1.3}, [F32]),
    ("LeakyReluGrad", ops.leaky_relu_grad, True, {}, [F32, F16]),
    ("LeakyReluGrad", ops.leaky_relu_grad, True, {"alpha": 0.3}, [F32]),
]
PARAMS = [(n, f, out, a, d) for n, f, out, a, ds in UNARY for d in ds]
IDS = [f"{p[0]}{p[3]}-{np.dtype(p[4]).name}" for p in PARAMS]


def _inputs(rng, shape, dtype, as_output, name):
    x = rng.standard_normal(shape) * 2
    x.flat[:3] = [0.0, -0.0, 1e-3]  # the threshold points
    if as_output:
        x = {"SigmoidGrad": lambda x: 1 / (1 + np.exp(-x)), "TanhGrad": np.tanh,
             "LeakyReluGrad": lambda x: np.where(x > 0, x, 0.01 * x)}[name](x)
    return rng.standard_normal(shape).astype(dtype), x.astype(dtype)


@pytest.mark.parametrize("name,fn,as_output,attrs,dtype", PARAMS, ids=IDS)
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 16)], ids=str)
def test_unary_matches_onnxruntime(rng, name, fn, as_output, attrs, dtype, shape):
    dy, x = _inputs(rng, shape, dtype, as_output, name)
    (expected,) = ort_oracle.run_node(name, [dy, x], **attrs)
    got = fn(jnp.asarray(dy), jnp.asarray(x), **attrs)
    assert got.dtype == dtype
    # ORT's f64 FastGeluGrad agrees to ~1e-9 only (its constants, not its formula, differ)
    loose = dtype == F64 and name == "FastGeluGrad"
    assert_close(got, expected.astype(np.float64), F32 if loose else dtype, ulps=8)


@pytest.mark.parametrize("name,fn", [("BiasGeluGrad_dX", ops.bias_gelu_grad_dx),
                                     ("BiasFastGeluGrad_dX", ops.bias_fast_gelu_grad_dx)])
@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
def test_bias_matches_onnxruntime(rng, name, fn, dtype):
    dy, x = (rng.standard_normal((4, 3, 24)).astype(dtype) for _ in range(2))
    b = rng.standard_normal(24).astype(dtype)
    (expected,) = ort_oracle.run_node(name, [dy, x, b])
    got = fn(jnp.asarray(dy), jnp.asarray(x), jnp.asarray(b))
    assert got.dtype == dtype
    assert_close(got, expected.astype(np.float64), dtype, ulps=8)


def test_fake_quant_grad_matches_onnxruntime(rng):
    dy = rng.standard_normal((5, 6)).astype(F32)
    mask = rng.random((5, 6)) > 0.5
    (expected,) = ort_oracle.run_node("FakeQuantGrad", [dy, mask])
    np.testing.assert_array_equal(ops.fake_quant_grad(jnp.asarray(dy), jnp.asarray(mask)),
                                  expected)


@pytest.mark.parametrize("a_shape,b_shape", [((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 4), (3, 1)),
                                             ((2, 1, 4), (3, 1)), ((4,), (2, 3, 4)),
                                             ((2, 3), ())], ids=str)
@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
def test_div_grad_matches_onnxruntime(rng, a_shape, b_shape, dtype):
    full = np.broadcast_shapes(a_shape, b_shape)
    dy = rng.standard_normal(full).astype(dtype)
    a = rng.standard_normal(a_shape).astype(dtype)
    b = ((rng.random(b_shape) + 0.5) * rng.choice([-1, 1], b_shape)).astype(dtype)
    expected = ort_oracle.run_node("DivGrad", [dy, a, b], out_dtypes=[dtype, dtype])
    got = ops.div_grad(jnp.asarray(dy), jnp.asarray(a), jnp.asarray(b))
    # broadcast operands get sums of terms that may cancel: tolerance from the terms' magnitudes
    terms = (np.abs(dy / b), np.abs(dy * a / (b * b)))
    for g, e, t in zip(got, expected, terms):
        assert g.shape == e.shape
        scale = _sum_to(jnp.asarray(t, jnp.float64), e.shape)
        assert_close(g, e.astype(np.float64), dtype, ulps=16, scale=scale)

