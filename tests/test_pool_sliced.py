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
from jaxops._src import taps
from jaxops.ops import pool_cpu
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


@pytest.mark.parametrize("slice_first", [True, False], ids=["slices_padded", "padded_sliced"])
@pytest.mark.parametrize("include", [0, 1])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("shape,attrs", CASES)
def test_sliced_pool_matches_ort(op, shape, attrs, include, slice_first, monkeypatch):
    # both forms of the taps: each a slice of x padded (small inputs), or slices of x padded
    # once (large ones); not MaxPool's CPU kernel (test_max_pool_kernel_matches_ort)
    monkeypatch.setattr(pool_cpu, "applies", lambda *a: False)
    monkeypatch.setattr(taps, "SLICE_FIRST_MAX", 1 << 40 if slice_first else 0)
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


@pytest.mark.parametrize("shape,attrs", [c for c in CASES if len(c[0]) == 4])
def test_max_pool_kernel_matches_ort(shape, attrs):
    # a 2-D MaxPool in a graph without ConvGrad: the CPU kernel (ops.pool_cpu) on the CPU
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    (want,) = ort_oracle.run_node("MaxPool", [x], domain="", **attrs)
    program = jax.jit(_program("MaxPool", shape, attrs).jit())
    np.testing.assert_array_equal(np.asarray(program(x)), want)
    if jax.default_backend() == "cpu":
        assert "jaxops_max_pool_nhwc" in program.lower(x).compile().as_text()


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


# MaxPool with Indices (handlers/pool.py's _max_pool_with_indices): a running max over the tap
# slices on the CPU, the gather elsewhere (and past _MAX_TAPS taps).

def _indices_program(shape, attrs, dtype=TensorProto.FLOAT):
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    return load(model([node], [vi("x", dtype, list(shape))],
                      [vi("y", dtype), vi("i", TensorProto.INT64)]))


def _both_forms(shape, attrs, x, monkeypatch, dtype=TensorProto.FLOAT):
    """(sliced, gathered): each form's (Y, Indices) as numpy."""
    prog = _indices_program(shape, attrs, dtype)
    sliced = [np.asarray(a) for a in jax.jit(prog.jit())(x)]
    with monkeypatch.context() as m:
        m.setattr(pool, "_MAX_TAPS", 0)  # every window through the gather
        gathered = [np.asarray(a) for a in jax.jit(_indices_program(shape, attrs, dtype).jit())(x)]
    return sliced, gathered


def _ort_indices(x, attrs):
    return ort_oracle.run_node("MaxPool", [x], [x.dtype, np.int64], domain="", **attrs)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("shape,attrs", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool_indices_match_ort_and_gather(shape, attrs, storage_order, ties, monkeypatch):
    if storage_order and len(shape) != 4:
        pytest.skip("ORT 1.19 takes storage_order in 2-D pools only")
    attrs = {**attrs, "storage_order": storage_order}
    rng = np.random.default_rng(3)
    # ties: a few distinct values, so that most windows hold their max more than once
    x = (rng.integers(-2, 2, shape) if ties else rng.standard_normal(shape)).astype(np.float32)
    want_y, want_i = _ort_indices(x, attrs)
    (y, i), (gy, gi) = _both_forms(shape, attrs, x, monkeypatch)
    assert i.dtype == np.int64
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(i, want_i)
    np.testing.assert_array_equal(gy, want_y)
    np.testing.assert_array_equal(gi, want_i)


def test_max_pool_indices_int8_ties_and_lowest(monkeypatch):
    shape, attrs = (2, 3, 7, 6), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    x = np.random.default_rng(4).integers(-128, -125, shape).astype(np.int8)
    x[0, 1] = -128  # every window of this image holds only the lowest value
    (y, i), (gy, gi) = _both_forms(shape, attrs, x, monkeypatch, TensorProto.INT8)
    want_y, want_i = _ort_indices(x, attrs)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal((y, i), (gy, gi))
    # ORT 1.19 answers c*H*W - W - 1 where every real value is -128; jaxops the first real tap
    ok = want_y != -128
    assert ok.sum() > 20 and not ok.all()
    np.testing.assert_array_equal(i[ok], want_i[ok])
    # window (0, 0) starts in the padding: rows 0, 1, 3, 5 and columns 0, 1, 3 come first
    np.testing.assert_array_equal(i[0, 1], np.asarray([[0, 1, 3], [6, 7, 9], [18, 19, 21],
                                                       [30, 31, 33]]) + 42)


def test_max_pool_indices_nan(monkeypatch):
    shape, attrs = (1, 2, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    x[0, 0, 0, 1] = x[0, 0, 1, 0] = x[0, 1, 3, 3] = np.nan  # window (0, 0) holds two
    (y, i), (gy, gi) = _both_forms(shape, attrs, x, monkeypatch)
    np.testing.assert_array_equal(y, gy)  # NaN compares equal here
    np.testing.assert_array_equal(i, gi)
    assert i[0, 0, 0, 0] == 1  # the window's first NaN in window order
    assert i[0, 1, 1, 1] == 36 + 21 and i[0, 1, 2, 2] == 36 + 21
    assert i[0, 0, 0, 1] == 1 and i[0, 0, 1, 0] == 6
    # Y and Indices as ORT's where a window holds no NaN. ORT 1.19 is not consistent about NaN:
    # its kernel with Indices skips NaN, the one without takes it or not by its position.
    want_y, want_i = _ort_indices(x, attrs)
    clean = ~np.isnan(y)
    assert clean.sum() == 9 - 3 + 9 - 4
    np.testing.assert_array_equal(y[clean], want_y[clean])
    np.testing.assert_array_equal(i[clean], want_i[clean])


def test_max_pool_indices_cpu_program_has_no_gather():
    shape, attrs = CASES[0]
    prog = _indices_program(shape, attrs)
    x = np.zeros(shape, np.float32)
    hlo = jax.jit(prog.jit()).lower(x).compile().as_text()
    assert "maximum" in hlo or "compare" in hlo
    assert " gather(" not in hlo
    with pytest.MonkeyPatch.context() as m:  # the check sees a gather where there is one
        m.setattr(pool, "_MAX_TAPS", 0)
        hlo = jax.jit(_indices_program(shape, attrs).jit()).lower(x).compile().as_text()
    assert " gather(" in hlo


def test_max_pool_indices_gradient_matches_gather(monkeypatch):
    shape, attrs = CASES[2]
    x = jnp.asarray(np.random.default_rng(6).standard_normal(shape).astype(np.float32))

    def loss(x):
        prog = _indices_program(shape, attrs)
        y, _ = prog(prog.params, x)
        return jnp.sum(y ** 2)
    sliced = jax.jit(jax.grad(loss))(x)
    monkeypatch.setattr(pool, "_MAX_TAPS", 0)
    gathered = jax.jit(jax.grad(loss))(x)
    assert float(jnp.abs(sliced).max()) > 0
    np.testing.assert_allclose(np.asarray(sliced), np.asarray(gathered), rtol=1e-6, atol=1e-6)
