"""MaxPool (no Indices) and AveragePool by strided tap slices (handlers/pool.py's _sliced)
against onnxruntime 1.19.2 (CPU), and their gradients against the gather form's."""
import jax
import jax.numpy as jnp
import numpy as np
import onnx.reference
import pytest
from onnx import TensorProto, helper

import ort_oracle
from jaxops.onnx import load
from jaxops.onnx.handlers import pool
from onnx_build import model, vi

CASES = [  # (x shape, attributes)
    ((2, 5, 16, 16), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),  # ResNet's
    ((1, 3, 9, 7), dict(kernel_shape=[3, 2], strides=[2, 3], ceil_mode=1)),
    ((1, 2, 10, 11), dict(kernel_shape=[2, 3], dilations=[2, 1], pads=[1, 0, 1, 1])),
    ((2, 3, 8, 8), dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2])),
    ((1, 4, 12), dict(kernel_shape=[4], strides=[3], pads=[2, 1], ceil_mode=1)),
    ((1, 2, 5, 6, 7), dict(kernel_shape=[2, 3, 2], strides=[1, 2, 2], pads=[1, 1, 0, 0, 1, 1])),
]


def _program(op, shape, attrs):
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    return load(model([node], [vi("x", shape=list(shape))], ["y"]))


@pytest.mark.parametrize("include", [0, 1])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("shape,attrs", CASES)
def test_sliced_pool_matches_ort(op, shape, attrs, include, monkeypatch):
    if op == "AveragePool" and "dilations" in attrs:
        pytest.skip("ORT 1.19's AveragePool (opset 17) has no dilations")
    if op == "MaxPool" and include:
        pytest.skip("count_include_pad is AveragePool's")
    if op == "AveragePool":
        attrs = {**attrs, "count_include_pad": include}
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    if include and attrs.get("ceil_mode"):
        # ORT 1.19 counts ceil_mode's overhang as padding; ONNX's reference (and jaxops,
        # sliced or gathered alike) does not
        m = model([helper.make_node(op, ["x"], ["y"], **attrs)], [vi("x", shape=list(shape))], ["y"])
        (want,) = onnx.reference.ReferenceEvaluator(m).run(None, {"x": x})
    else:
        (want,) = ort_oracle.run_node(op, [x], domain="", **attrs)
    # the gather form must not run: this checks the sliced one
    monkeypatch.setattr(pool, "_setup", lambda *a: pytest.fail("gather form used"))
    got = jax.jit(_program(op, shape, attrs).jit())(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_int8_max_pool_pads_with_the_lowest_value():
    x = np.random.default_rng(1).integers(-128, -100, (1, 2, 6, 6)).astype(np.int8)
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    node = helper.make_node("MaxPool", ["x"], ["y"], **attrs)
    prog = load(model([node], [vi("x", TensorProto.INT8, [1, 2, 6, 6])],
                      [vi("y", TensorProto.INT8)]))
    (want,) = ort_oracle.run_node("MaxPool", [x], domain="", **attrs)
    np.testing.assert_array_equal(np.asarray(prog.jit()(x)), want)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_sliced_pool_gradient_matches_gather(op, monkeypatch):
    shape, attrs = CASES[1]
    x = jnp.asarray(np.random.default_rng(2).standard_normal(shape).astype(np.float32))
    prog = _program(op, shape, attrs)

    def loss(x):
        return jnp.sum(prog(prog.params, x) ** 2)
    sliced = jax.jit(jax.grad(loss))(x)
    monkeypatch.setattr(pool, "_MAX_TAPS", 0)  # every window through the gather
    gathered = jax.jit(jax.grad(loss))(x)
    assert float(jnp.abs(sliced).max()) > 0
    np.testing.assert_allclose(np.asarray(sliced), np.asarray(gathered), rtol=1e-6, atol=1e-6)
