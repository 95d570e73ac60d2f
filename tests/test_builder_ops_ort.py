"""AveragePoolGrad and BroadcastGradientArgs against onnxruntime-training 1.19.2 (CPU), directly
and through the importer. Where ORT's AveragePoolGrad kernel disagrees with its own
AveragePool, jaxops is checked against the exact gradient of ORT's forward instead."""
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import helper

from helpers import assert_close
from jaxops import ops
from jaxops.onnx import load
from onnx_build import model, vi

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")

AGREE = [
    ((2, 3, 6, 6), dict(kernel_shape=[2, 2], strides=[2, 2])),
    ((2, 3, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((2, 3, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                        count_include_pad=1)),
    ((1, 2, 5, 6), dict(kernel_shape=[2, 3], strides=[2, 2], pads=[0, 1, 1, 0])),
    ((1, 2, 7), dict(kernel_shape=[3], strides=[2], pads=[1, 0])),
    ((1, 1, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ((1, 1, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1, count_include_pad=1)),
    ((1, 1, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    ((1, 1, 6, 5), dict(kernel_shape=[3, 2], auto_pad="VALID")),
]
DISAGREE = [  # ORT 1.19.2's gradient kernel differs from its forward's gradient here
    ((1, 2, 3, 4, 4), dict(kernel_shape=[2, 2, 2], strides=[1, 2, 2])),
    ((1, 1, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_LOWER")),
    ((1, 1, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_LOWER",
                        count_include_pad=1)),
]


def _dy(rng, x_shape, attrs):
    y = ort_oracle.run_node("AveragePool", [np.zeros(x_shape, np.float32)], domain="", **attrs)[0]
    return rng.standard_normal(y.shape).astype(np.float32)


@pytest.mark.parametrize("x_shape,attrs", AGREE, ids=[str(a) for _, a in AGREE])
def test_average_pool_grad_matches_onnxruntime(rng, x_shape, attrs):
    dy = _dy(rng, x_shape, attrs)
    (want,) = ort_oracle.run_node("AveragePoolGrad", [dy], domain="", out_shapes=[x_shape],
                                  **attrs)
    got = ops.average_pool_grad(jnp.asarray(dy), x_shape=x_shape, **attrs)
    assert_close(got, want.astype(np.float64), np.float32, ulps=4)


@pytest.mark.parametrize("x_shape,attrs", AGREE + DISAGREE,
                         ids=[str(a) for _, a in AGREE + DISAGREE])
def test_average_pool_grad_is_the_gradient_of_onnxruntime(rng, x_shape, attrs):
    """ORT's AveragePool is linear: its matrix, column by column, transposed onto dY."""
    n = int(np.prod(x_shape))
    cols = [ort_oracle.run_node("AveragePool", [np.eye(1, n, i, np.float32).reshape(x_shape)],
                                domain="", **attrs)[0].reshape(-1) for i in range(n)]
    dy = _dy(rng, x_shape, attrs)
    want = (np.stack(cols, 1).astype(np.float64).T @ dy.reshape(-1)).reshape(x_shape)
    got = ops.average_pool_grad(jnp.asarray(dy), x_shape=x_shape, **attrs)
    assert_close(got, want, np.float32, ulps=4)


@pytest.mark.parametrize("a,b", [([2, 3, 4], [4]), ([2, 1, 4], [3, 1]), ([5], [2, 3, 5]),
                                 ([2, 3], []), ([3, 1, 1], [1, 1, 1]), ([0, 3], [1, 3])], ids=str)
def test_broadcast_gradient_args_matches_onnxruntime(a, b):
    inputs = [np.array(a, np.int64), np.array(b, np.int64)]
    want = ort_oracle.run_node("BroadcastGradientArgs", inputs, out_dtypes=[np.int64] * 2)
    got = ops.broadcast_gradient_args(*inputs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_importer_runs_average_pool_grad_and_broadcast_gradient_args(rng):
    """A graph slice as ORT's builders write them: X's shape from the declared output, and
    broadcast axes from Shape -> BroadcastGradientArgs feeding ReduceSum."""
    attrs = dict(kernel_shape=[2, 2], strides=[2, 2])
    nodes = [helper.make_node("AveragePoolGrad", ["dy"], ["dx"], **attrs),
             helper.make_node("Shape", ["dx"], ["sx"]),
             helper.make_node("Shape", ["b"], ["sb"]),
             helper.make_node("BroadcastGradientArgs", ["sx", "sb"], ["ax", "ab"],
                              domain="com.microsoft"),
             helper.make_node("ReduceSum", ["dx", "ab"], ["db"], keepdims=0)]
    m = model(nodes, [vi("dy", shape=[2, 3, 2, 2]), vi("b", shape=[4])],
              [vi("dx", shape=[2, 3, 4, 4]), vi("db")], opset=13, domains=("com.microsoft",))
    feeds = {"dy": rng.standard_normal((2, 3, 2, 2)).astype(np.float32),
             "b": np.zeros(4, np.float32)}
    import onnxruntime as ort
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds)
    prog = load(m)
    got = prog(prog.params, feeds["dy"], feeds["b"])
    for g, w in zip(got, want):
        assert_close(g, w.astype(np.float64), np.float32, ulps=4)
