"""ai.onnx handlers beyond the node suite: static shape values stay numpy, and typical
layers work under jit, grad and vmap (the node suite runs everything eagerly)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from onnx import TensorProto, helper

from jaxops.onnx import OnnxImportError, load
from onnx_build import model, vi

RNG = np.random.default_rng(0)
node = helper.make_node


def _f(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_shape_arithmetic_resolves_under_jit():
    """Shape -> Gather -> Mul -> Concat -> Reshape and Slice/Range/ConstantOfShape on shapes
    resolve statically though x is traced."""
    nodes = [
        node("Shape", ["x"], ["s"]),
        node("Gather", ["s", "i0"], ["d0"], axis=0),
        node("Slice", ["s", "one", "big"], ["rest"]),
        node("ReduceProd", ["rest"], ["n"], keepdims=1),
        node("Concat", ["d0", "n"], ["shape"], axis=0),
        node("Reshape", ["x", "shape"], ["y"]),
        node("Range", ["zero", "d0s", "onei"], ["r"]),
        node("ConstantOfShape", ["rest"], ["z"]),
        node("Add", ["y", "yb"], ["out"]),
    ]
    inits = {"i0": np.array([0], np.int64), "one": np.array([1], np.int64),
             "big": np.array([100], np.int64), "zero": np.array(0, np.int64),
             "d0s": np.array(2, np.int64), "onei": np.array(1, np.int64),
             "yb": np.zeros((1, 12), np.float32)}
    p = load(model(nodes, ["x"], ["out", "r", "z"], inits, opset=17))
    x = _f(2, 3, 4)
    out, r, z = jax.jit(lambda x: p(p.params, x))(x)
    np.testing.assert_allclose(out, x.reshape(2, 12), rtol=1e-6)
    np.testing.assert_array_equal(r, [0, 1])
    assert z.shape == (3, 4)


def test_data_dependent_shape_is_a_clear_error():
    p = load(model([node("Reshape", ["x", "s"], ["y"])],
                   ["x", vi("s", TensorProto.INT64, [2])], ["y"], opset=17))
    with pytest.raises(OnnxImportError, match="Reshape"):
        jax.jit(lambda x, s: p(p.params, x, s))(_f(2, 3), np.array([3, 2], np.int64))


def _cnn():
    nodes = [
        node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[1, 1]),
        node("BatchNormalization", ["c", "g", "beta", "m", "v"], ["bn"]),
        node("Relu", ["bn"], ["r"]),
        node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        # a Constant, not a float initializer: those become (traced) params
        node("Constant", [], ["scales"], value=helper.make_tensor(
            "s", TensorProto.FLOAT, [4], [1, 1, 2, 2])),
        node("Resize", ["p", "", "scales"], ["u"], mode="linear"),
        node("GlobalAveragePool", ["u"], ["gap"]),
        node("Flatten", ["gap"], ["f"]),
        node("Gemm", ["f", "fc"], ["logits"], transB=1),
        node("LayerNormalization", ["logits", "ln"], ["y"]),
    ]
    inits = {"w": _f(4, 3, 3, 3), "b": _f(4), "g": _f(4), "beta": _f(4),
             "m": _f(4), "v": np.abs(_f(4)) + 1,
             "fc": _f(5, 4), "ln": _f(5)}
    return load(model(nodes, ["x"], ["y"], inits, opset=18))


def test_cnn_jit_grad_vmap():
    p = _cnn()
    x = _f(2, 3, 8, 8)
    eager = p(p.params, x)
    np.testing.assert_allclose(jax.jit(lambda q, x: p(q, x))(p.params, x), eager, rtol=1e-5, atol=1e-5)
    loss = lambda q, x: jnp.sum(jnp.sin(p(q, x)))
    g = jax.jit(jax.grad(loss))(p.params, x)
    assert set(g) == set(p.params) and all(np.isfinite(v).all() for v in jax.tree.leaves(g))
    batched = jax.vmap(lambda x: p(p.params, x[None])[0])(x)
    np.testing.assert_allclose(batched, eager, rtol=1e-5, atol=1e-5)


def test_conv_pool_grads_numerically():
    nodes = [node("Conv", ["x", "w"], ["c"], pads=[1, 0, 1, 0], strides=[2, 1], group=2),
             node("AveragePool", ["c"], ["a"], kernel_shape=[2, 2], pads=[0, 0, 1, 1]),
             node("ConvTranspose", ["a", "wt"], ["y"], strides=[2, 2])]
    p = load(model(nodes, ["x"], ["y"], {"w": _f(4, 1, 3, 3), "wt": _f(4, 2, 2, 2)}, opset=17))
    params = jax.tree.map(lambda v: v.astype(np.float64), p.params)
    x = _f(1, 2, 6, 5).astype(np.float64)
    check_grads(lambda q, x: p(q, x), (params, x), order=1, modes=["rev"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_recurrent_layers_jit_and_grad(op):
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    h = 3
    n = node(op, ["x", "W", "R", "B"], ["y", "yh"], hidden_size=h, direction="bidirectional")
    inits = {"W": _f(2, gates * h, 2), "R": _f(2, gates * h, h), "B": _f(2, 2 * gates * h)}
    p = load(model([n], ["x"], ["y", "yh"], inits, opset=14))
    x = _f(5, 2, 2)
    y, yh = jax.jit(lambda q, x: p(q, x))(p.params, x)
    assert y.shape == (5, 2, 2, h) and yh.shape == (2, 2, h)
    np.testing.assert_allclose(yh[0], y[-1, 0], rtol=1e-6)  # forward ends at the last step
    np.testing.assert_allclose(yh[1], y[0, 1], rtol=1e-6)  # reverse ends at the first
    g = jax.jit(jax.grad(lambda q: jnp.sum(p(q, x)[0] ** 2)))(p.params)
    assert all(np.isfinite(v).all() and np.abs(v).sum() > 0 for v in jax.tree.leaves(g))


def test_attention_with_causal_mask_under_jit():
    n = node("Attention", ["q", "k", "v"], ["y"], is_causal=1)
    p = load(model([n], ["q", "k", "v"], ["y"], opset=23))
    q, k, v = _f(1, 2, 4, 8), _f(1, 2, 4, 8), _f(1, 2, 4, 8)
    y = jax.jit(lambda *a: p(p.params, *a))(q, k, v)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(8)
    s = np.where(np.tril(np.ones((4, 4), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
