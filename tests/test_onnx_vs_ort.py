"""Differential tests: random small graphs of standard ops (and of the com.microsoft training
ops that jaxops.ops.ORT_OPS holds) run through onnxruntime and through the importer (jitted);
the outputs must agree. Ops without a handler yet, or without an ORT kernel, are left out of
the pool, so the test skips cleanly rather than failing for what is not there."""
import jax
import numpy as np
import pytest

pytest.importorskip("onnx")
from onnx import TensorProto, helper
from onnx_build import model

from jaxops.onnx import OnnxImportError, load
from jaxops.onnx.resolve import is_supported

ort = pytest.importorskip("onnxruntime")

GRAPHS = 12
NODES = 6
SHAPE = (3, 4)

# Each template: (ops it uses with their domain, builder). A builder gets two value names a, b
# of shape SHAPE, a fresh-name function and the initializer dict; it returns its nodes and the
# name of a new SHAPE-shaped value.


def _unary(op, **kw):
    return ([("", op)], lambda a, b, new, init: ([helper.make_node(op, [a], [o := new()], **kw)],
                                                 o))


def _binary(op):
    return ([("", op)], lambda a, b, new, init: ([helper.make_node(op, [a, b], [o := new()])], o))


def _matmul(a, b, new, init):
    t, m, o = new(), new(), new()
    return [helper.make_node("Transpose", [b], [t], perm=[1, 0]),
            helper.make_node("MatMul", [a, t], [m]),  # [3, 3]
            helper.make_node("MatMul", [m, b], [o])], o  # [3, 4]


def _reduce_broadcast(a, b, new, init):
    axes, r, o = new(), new(), new()
    init[axes] = np.array([1], np.int64)
    return [helper.make_node("ReduceSum", [a, axes], [r], keepdims=1),
            helper.make_node("Add", [r, b], [o])], o


def _concat_slice(a, b, new, init):
    c, s, e, ax, o = new(), new(), new(), new(), new()
    init.update({s: np.array([2], np.int64), e: np.array([6], np.int64),
                 ax: np.array([1], np.int64)})
    return [helper.make_node("Concat", [a, b], [c], axis=1),
            helper.make_node("Slice", [c, s, e, ax], [o])], o


def _shape_reshape(a, b, new, init):
    """Static shape arithmetic: Reshape(a, Shape(b)) through a transposed view."""
    t, shp, r, o = new(), new(), new(), new()
    return [helper.make_node("Transpose", [a], [t], perm=[1, 0]),
            helper.make_node("Shape", [b], [shp]),
            helper.make_node("Reshape", [t, shp], [r]),
            helper.make_node("Mul", [r, b], [o])], o


def _gather_rows(a, b, new, init):
    idx, o = new(), new()
    init[idx] = np.array([2, 0, 1], np.int64)
    return [helper.make_node("Gather", [a, idx], [o], axis=0)], o


def _where(a, b, new, init):
    g, o = new(), new()
    return [helper.make_node("Greater", [a, b], [g]), helper.make_node("Where", [g, a, b], [o])], o


def _grad_of(op, forward=None, **kw):
    """A com.microsoft gradient op: dY = a, second input = b (or forward(b))."""
    def build(a, b, new, init):
        nodes, y = [], b
        if forward:
            nodes.append(helper.make_node(forward, [b], [y := new()], **(
                {"axis": -1} if forward.endswith("Softmax") else {})))
        nodes.append(helper.make_node(op, [a, y], [o := new()], domain="com.microsoft", **kw))
        return nodes, o
    uses = [("com.microsoft", op)] + ([("", forward)] if forward else [])
    return uses, build


TEMPLATES = {
    "relu": _unary("Relu"), "sigmoid": _unary("Sigmoid"), "tanh": _unary("Tanh"),
    "abs": _unary("Abs"), "neg": _unary("Neg"), "softmax": _unary("Softmax", axis=-1),
    "logsoftmax": _unary("LogSoftmax", axis=0), "add": _binary("Add"), "sub": _binary("Sub"),
    "mul": _binary("Mul"), "max": _binary("Max"), "min": _binary("Min"),
    "matmul": ([("", "Transpose"), ("", "MatMul")], _matmul),
    "reduce": ([("", "ReduceSum"), ("", "Add")], _reduce_broadcast),
    "concat_slice": ([("", "Concat"), ("", "Slice")], _concat_slice),
    "shape_reshape": ([("", "Transpose"), ("", "Shape"), ("", "Reshape"), ("", "Mul")],
                      _shape_reshape),
    "gather": ([("", "Gather")], _gather_rows),
    "where": ([("", "Greater"), ("", "Where")], _where),
    "relu_grad": _grad_of("ReluGrad"),
    "sigmoid_grad": _grad_of("SigmoidGrad", "Sigmoid"),
    "tanh_grad": _grad_of("TanhGrad", "Tanh"),
    "gelu_grad": _grad_of("GeluGrad"),
    "fast_gelu_grad": _grad_of("FastGeluGrad"),
    "quick_gelu_grad": _grad_of("QuickGeluGrad", alpha=1.5),
    "softmax_grad_13": _grad_of("SoftmaxGrad_13", "Softmax", axis=-1),
    "log_softmax_grad_13": _grad_of("LogSoftmaxGrad_13", "LogSoftmax", axis=-1),
}


def _session(m):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def _one_template_model(name):
    uses, build = TEMPLATES[name]
    init = {}
    nodes, out = build("a", "b", iter(f"v{i}" for i in range(99)).__next__, init)
    domains = ("com.microsoft",) if any(d for d, _ in uses) else ()
    return model(nodes, [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE)
                         for n in "ab"], [out], init, domains=domains)


def _available():
    """Templates whose ops have handlers here and kernels in this onnxruntime."""
    ok, x = [], np.ones(SHAPE, np.float32)
    for name, (uses, _) in TEMPLATES.items():
        if not all(is_supported(d, op, 17) for d, op in uses):
            continue
        m = _one_template_model(name)
        try:
            _session(m)
        except Exception:  # noqa: BLE001 - no kernel in this onnxruntime (e.g. not -training)
            continue
        try:  # an op expanded from its schema's function may need ops with no handler yet
            p = load(m)
            p(p.params, x, x)
        except OnnxImportError:
            continue
        ok.append(name)
    return ok


AVAILABLE = _available()


def random_graph(rng):
    values, nodes, init, counter = ["a", "b"], [], {}, iter(range(10 ** 6))
    used_ms = False
    for _ in range(NODES):
        name = AVAILABLE[rng.integers(len(AVAILABLE))]
        uses, build = TEMPLATES[name]
        used_ms |= any(d == "com.microsoft" for d, _ in uses)
        a, b = (values[i] for i in rng.integers(len(values), size=2))
        new_nodes, out = build(a, b, lambda: f"t{next(counter)}", init)
        nodes += new_nodes
        values.append(out)
    outputs = [values[-1]] + ([values[-2]] if values[-2] not in ("a", "b") else [])
    m = model(nodes, [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in "ab"],
              outputs, init, domains=("com.microsoft",) if used_ms else ())
    return m


@pytest.mark.skipif(len(AVAILABLE) < 3, reason=f"too few ops with handlers: {AVAILABLE}")
@pytest.mark.parametrize("graph", range(GRAPHS))
def test_random_graph_matches_onnxruntime(graph, rng):
    m = random_graph(rng)
    x = {n: rng.normal(size=SHAPE).astype(np.float32) for n in "ab"}
    want = _session(m).run(None, x)
    p = load(m)
    got = jax.jit(p.run)(p.params, **x)
    ops = [n.op_type for n in m.graph.node]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-5, err_msg=str(ops))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_op_template_matches_onnxruntime(name, rng):
    if name not in AVAILABLE:
        pytest.skip(f"{name}: no handler here or no kernel in onnxruntime {ort.__version__}")
    m = _one_template_model(name)
    x = {n: rng.normal(size=SHAPE).astype(np.float32) for n in "ab"}
    want = _session(m).run(None, x)[0]
    p = load(m)
    np.testing.assert_allclose(np.asarray(p(p.params, **x)), want, rtol=2e-4, atol=2e-5)


def test_initializers_are_params(rng):
    """A graph whose weight is an initializer: same result, and the weight is a param."""
    w = rng.normal(size=(4, 4)).astype(np.float32)
    m = model([helper.make_node("MatMul", ["a", "w"], ["y"])],
              [helper.make_tensor_value_info("a", TensorProto.FLOAT, SHAPE)], ["y"], {"w": w})
    if not is_supported("", "MatMul", 17):
        pytest.skip("no MatMul handler yet")
    x = rng.normal(size=SHAPE).astype(np.float32)
    p = load(m)
    assert list(p.params) == ["w"]
    np.testing.assert_allclose(p(p.params, x), _session(m).run(None, {"a": x})[0], rtol=1e-5)
