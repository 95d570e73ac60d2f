"""com.microsoft forward contrib ops (and ORT's pre-opset-17 LayerNormalization family) through
the importer, compared with onnxruntime's own CPU kernels."""
import numpy as np
import pytest
from onnx import helper

from onnx_build import model, vi

from jaxops.onnx import load

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)


def _run_both(node, feeds, n_out=1, opset=17):
    names = list(feeds)
    outs = [f"y{i}" for i in range(n_out)]
    node.output[:] = outs
    m = model([node], [vi(n) for n in names], [vi(o) for o in outs], opset=opset,
              domains=("com.microsoft",))
    try:
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - this ORT build lacks the kernel
        pytest.skip(f"onnxruntime cannot run it: {str(e)[:80]}")
    want = sess.run(None, feeds)
    prog = load(m)
    got = prog(prog.params, *[feeds[n] for n in names])
    got = got if isinstance(got, (list, tuple)) else [got]
    return want, got


def _x(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("op,inputs,attrs", [
    ("Gelu", [(2, 8)], {}),
    ("BiasGelu", [(2, 8), (8,)], {}),
    ("FastGelu", [(2, 8)], {}),
    ("FastGelu", [(2, 8), (8,)], {}),
    ("QuickGelu", [(2, 8)], {"alpha": 1.5}),
    ("FusedMatMul", [(3, 4), (4, 5)], {"alpha": 0.5}),
    ("FusedMatMul", [(2, 4, 3), (2, 5, 4)], {"transA": 1, "transB": 1}),
    ("FusedMatMul", [(2, 3, 4), (3, 4, 5)], {"transBatchA": 1}),
    ("FusedMatMul", [(3, 2, 4), (5, 3, 4)], {"transBatchB": 1, "transB": 1}),
    ("SkipLayerNormalization", [(2, 3, 8), (2, 3, 8), (8,), (8,), (8,)], {"epsilon": 1e-5}),
    ("SkipSimplifiedLayerNormalization", [(2, 3, 8), (2, 3, 8), (8,)], {"epsilon": 1e-5}),
])
def test_contrib_op_matches_onnxruntime(op, inputs, attrs):
    feeds = {f"x{i}": _x(*s) for i, s in enumerate(inputs)}
    node = helper.make_node(op, list(feeds), ["y0"], domain="com.microsoft", **attrs)
    want, got = _run_both(node, feeds)
    np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("op,n_in", [("LayerNormalization", 3), ("SimplifiedLayerNormalization", 2)])
def test_onnx_domain_layer_norms_below_opset17(op, n_in):
    shapes = [(2, 3, 8), (8,), (8,)][:n_in]
    feeds = {f"x{i}": _x(*s) for i, s in enumerate(shapes)}
    node = helper.make_node(op, list(feeds), ["y0"], axis=-1, epsilon=1e-5)
    want, got = _run_both(node, feeds, opset=13)
    np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("op,domain,opset", [("Gelu", "com.microsoft", 17), ("Gelu", "", 20),
                                             ("BiasGelu", "com.microsoft", 17)])
def test_erf_gelu_matches_onnxruntime_over_its_range(op, domain, opset):
    """Gelu (0.5 x (1 + erf(x / sqrt(2)))) from the far negative tail to large positive
    inputs: within 2e-6 of ORT's relative, and in the tail (x < -3, where ORT's 1 + erf keeps a
    few bits) within 2 eps |x| absolute."""
    feeds = {"x0": np.linspace(-12, 12, 4001, dtype=np.float32).reshape(1, -1)}
    if op == "BiasGelu":
        feeds["x1"] = _x(4001)
    node = helper.make_node(op, list(feeds), ["y0"], domain=domain)
    want, got = _run_both(node, feeds, opset=opset)
    x = sum(feeds.values())
    bound = 2e-6 * np.abs(want[0]) + 2 * np.finfo(np.float32).eps * np.abs(x)
    assert np.all(np.abs(np.asarray(got[0]) - want[0]) <= bound)
