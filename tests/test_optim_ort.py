"""Optimizers against onnxruntime-training 1.19.2 on CPU (not LambOptimizer: ORT has no CPU
kernel for it; test_optim.py checks it against the spec). ORT writes into the arrays fed to
AdamW/SGDOptimizerV2, so every input is copied first."""
import jax.numpy as jnp
import numpy as np
import pytest
from ort_oracle import helper, onnx, ort, run_node

from jaxops import ops

F32 = onnx.TensorProto.FLOAT
SHAPES = [(3, 4), (5,), (2, 3, 2), (1,)]


def run_seq_node(op_type, inputs, outputs, **attrs):
    """One node whose inputs/outputs may be sequences: inputs is [(name, value)] with a list
    value for a sequence; outputs is [(name, elem_type, is_sequence)]."""
    def info(name, value):
        if isinstance(value, list):
            return helper.make_tensor_sequence_value_info(name, _elem(value[0]), None)
        return helper.make_tensor_value_info(name, _elem(value), value.shape)

    def out_info(name, elem, seq):
        if seq:
            return helper.make_tensor_sequence_value_info(name, elem, None)
        return helper.make_tensor_value_info(name, elem, None)

    node = helper.make_node(op_type, [n for n, _ in inputs], [o[0] for o in outputs],
                            domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], "oracle", [info(n, v) for n, v in inputs],
                              [out_info(*o) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    copy = lambda v: [np.array(x, copy=True) for x in v] if isinstance(v, list) else v.copy()
    return session.run(None, {n: copy(v) for n, v in inputs})


def _elem(x):
    return {np.dtype(np.float32): F32, np.dtype(np.float64): onnx.TensorProto.DOUBLE,
            np.dtype(np.int64): onnx.TensorProto.INT64,
            np.dtype(np.bool_): onnx.TensorProto.BOOL}[x.dtype]


def _lists(rng, dtype=np.float32, shapes=SHAPES):
    w = [rng.standard_normal(s).astype(dtype) for s in shapes]
    g = [rng.standard_normal(s).astype(dtype) for s in shapes]
    m1 = [0.1 * rng.standard_normal(s).astype(dtype) for s in shapes]
    m2 = [np.abs(0.1 * rng.standard_normal(s)).astype(dtype) for s in shapes]
    return w, g, m1, m2


def _assert_lists(actual, expected, rtol=4e-7, before=None):
    """Within a few f32 ulps (ORT's Eigen loops fuse multiply-adds differently), scaled to the
    tensor's magnitude (and its magnitude before the update, `before`) near cancellation;
    rtol=0 asks for equality."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape and a.dtype == e.dtype
        scale = np.abs(e).max(initial=0)
        if before is not None:
            scale = max(scale, np.abs(before[i]).max(initial=0))
        tol = rtol * scale
        np.testing.assert_allclose(np.asarray(a), e, rtol=rtol, atol=tol)


def _adamw_ort(lr, step, w, g, m1, m2, signal=None, **attrs):
    inputs = [("lr", lr), ("step", step), ("w", w), ("g", g), ("m1", m1), ("m2", m2)]
    if signal is not None:
        inputs.append(("signal", signal))
    elem = _elem(w[0])
    return run_seq_node("AdamWOptimizer", inputs,
                        [("flag", onnx.TensorProto.BOOL, False), ("nw", elem, True),
                         ("nm1", elem, True), ("nm2", elem, True)], **attrs)


@pytest.mark.parametrize("adam_mode", [0, 1])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("correct_bias", [0, 1])
@pytest.mark.parametrize("step", [1, 7])
def test_adamw(rng, adam_mode, weight_decay, correct_bias, step):
    if adam_mode == 0 and correct_bias == 0:
        pytest.skip("ORT refuses correct_bias=0 with adam_mode 0 (test_optim checks jaxops does)")
    w, g, m1, m2 = _lists(rng)
    lr, st = np.array([0.05], np.float32), np.array([step], np.int64)
    attrs = dict(alpha=0.9, beta=0.999, epsilon=1e-6, weight_decay=weight_decay,
                 correct_bias=correct_bias, adam_mode=adam_mode)
    flag, nw, nm1, nm2 = _adamw_ort(lr, st, w, g, m1, m2, **attrs)
    out = ops.adamw_optimizer(lr, st, w, g, m1, m2, **attrs)
    assert out[0].dtype == jnp.bool_ and out[0].shape == flag.shape and bool(out[0][0])
    for a, e, old in zip(out[1:], (nw, nm1, nm2), (w, m1, m2)):
        _assert_lists(a, e, before=old)


def test_adamw_onnxblock_defaults_over_steps(rng):
    # the node generate_artifacts emits: eps 1e-6, no decay, HF mode; the caller increments step
    w, g, m1, m2 = _lists(rng)
    attrs = dict(alpha=0.9, beta=0.999, epsilon=1e-6, weight_decay=0.0, correct_bias=1,
                 adam_mode=1)
    jw, jm1, jm2 = w, m1, m2
    for step in range(1, 6):
        lr, st = np.array([1e-2], np.float32), np.array([step], np.int64)
        g = [rng.standard_normal(x.shape).astype(np.float32) for x in w]
        _, w, m1, m2 = _adamw_ort(lr, st, w, g, m1, m2, **attrs)
        _, jw, jm1, jm2 = ops.adamw_optimizer(lr, st, jw, g, jm1, jm2, **attrs)
        jw, jm1, jm2 = ([np.asarray(x) for x in xs] for xs in (jw, jm1, jm2))
    for a, e in zip((jw, jm1, jm2), (w, m1, m2)):
        _assert_lists(a, e, rtol=1e-6)


def test_adamw_update_signal_false(rng):
    w, g, m1, m2 = _lists(rng)
    lr, st, sig = np.array([0.05], np.float32), np.array([3], np.int64), np.array([False])
    flag, *expected = _adamw_ort(lr, st, w, g, m1, m2, sig)
    out = ops.adamw_optimizer(lr, st, w, g, m1, m2, sig)
    assert not bool(out[0][0]) and not bool(np.asarray(flag).reshape(-1)[0])
    for a, e in zip(out[1:], expected):
        _assert_lists(a, e, rtol=0)


def test_adamw_step_zero_is_nan_like_ort(rng):
    w, g, m1, m2 = _lists(rng, shapes=[(4,)])
    lr, st = np.array([0.05], np.float32), np.array([0], np.int64)
    expected = _adamw_ort(lr, st, w, g, m1, m2, correct_bias=1)
    out = ops.adamw_optimizer(lr, st, w, g, m1, m2, correct_bias=1)
    assert np.isnan(expected[1][0]).all() and np.isnan(np.asarray(out[1][0])).all()


def _sgd_ort(lr, w, g, signal=None):
    inputs = [("lr", lr), ("w", w), ("g", g)] + ([("signal", signal)] if signal is not None else [])
    return run_seq_node("SGDOptimizerV2", inputs, [("flag", onnx.TensorProto.BOOL, False),
                                                   ("nw", _elem(w[0]), True)])


@pytest.mark.parametrize("signal", [None, True, False])
def test_sgd_v2(rng, signal):  # ORT's CPU kernels are float32 only
    w, g, _, _ = _lists(rng)
    lr = np.array([0.1], np.float32)
    sig = None if signal is None else np.array([signal])
    flag, nw = _sgd_ort(lr, w, g, sig)
    out_flag, out_w = ops.sgd_optimizer_v2(lr, w, g, sig)
    assert out_flag.shape == np.asarray(flag).shape == lr.shape
    assert bool(out_flag[0]) == bool(np.asarray(flag)[0]) == (signal is not False)
    _assert_lists(out_w, nw, rtol=0)


def test_sgd_v2_scalar_lr_flag_shape(rng):
    w, g, _, _ = _lists(rng, shapes=[(3,)])
    lr = np.array(0.1, np.float32)
    flag, nw = _sgd_ort(lr, w, g)
    out_flag, out_w = ops.sgd_optimizer_v2(lr, w, g)
    assert out_flag.shape == np.asarray(flag).shape == ()
    _assert_lists(out_w, nw, rtol=0)


def test_sgd_optimizer(rng):
    eta = np.array([0.3], np.float32)
    w, g = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((4, 5)).astype(np.float32)
    nw, ng = run_node("SGDOptimizer", [eta, w, g], [np.float32, np.float32])
    out = ops.sgd_optimizer(eta, w, g)
    np.testing.assert_allclose(out[0], nw, rtol=1e-7)
    np.testing.assert_allclose(out[1], ng, rtol=1e-7)


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("lam", [0.0, 0.01])
@pytest.mark.parametrize("T", [0, 4])
def test_adam_optimizer(rng, mode, lam, T):
    shape = (3, 5)
    r = np.array(0.05, np.float32)
    t = np.array(T, np.int64)
    w, g = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    m1 = 0.1 * rng.standard_normal(shape).astype(np.float32)
    m2 = np.abs(0.1 * rng.standard_normal(shape)).astype(np.float32)
    attrs = {"lambda": lam, "weight_decay_mode": mode, "epsilon": 1e-6}
    expected = run_node("AdamOptimizer", [r, t, w, g, m1, m2],
                        [np.int64, np.float32, np.float32, np.float32, np.float32], **attrs)
    out = ops.adam_optimizer(r, t, w, g, m1, m2, **attrs)
    assert int(out[0]) == int(expected[0]) == T + 1
    _assert_lists(out[1:5], expected[1:], rtol=4e-6)  # XLA code: its own rounding order


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_inplace_clip_grad_norm(rng, max_norm):
    g = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    (expected,) = run_seq_node("InplaceClipGradNorm", [("g", g)], [("out", F32, True)],
                               max_norm=max_norm)
    _assert_lists(ops.inplace_clip_grad_norm(g, max_norm=max_norm), expected, rtol=1e-6)


def test_reduce_all_l2(rng):
    xs = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    names = [(f"x{i}", x) for i, x in enumerate(xs)]
    (expected,) = run_seq_node("ReduceAllL2", names, [("y", F32, False)])
    np.testing.assert_allclose(ops.reduce_all_l2(*xs), expected, rtol=1e-6)
    assert ops.reduce_all_l2(*xs).shape == np.asarray(expected).shape


@pytest.mark.parametrize("scale_down", [0, 1])
@pytest.mark.parametrize("scale_dtype", [np.float32, np.int64], ids=["f32", "i64"])
def test_scale(rng, scale_down, scale_dtype):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    s = np.array([3], scale_dtype)
    (expected,) = run_node("Scale", [x, s], [np.float32], scale_down=scale_down)
    np.testing.assert_allclose(ops.scale(x, s, scale_down=scale_down), expected, rtol=1e-7)
