"""The importer's fused Conv (jaxops/onnx/handlers/fused_conv.py): which chains the rewrite
takes (and which it leaves), and that a fused chain gives the unfused nodes' values (the kernel's
epilogue on the CPU: NaN kept, gradients the unfused formula's), ORT's too."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import helper

from jaxops.onnx import load
from jaxops.onnx.handlers.fused_conv import fuse_conv
from onnx_build import model


def _chain(c=8, o=16, group=1, k=3, bias=True, bn=True, act="Relu", clip=(0.0, 6.0),
           clip_from_input=False, training_mode=0, extra_user=False, bn_output=False,
           opset=17, seed=0):
    """x [2, c, 9, 9] -> Conv (pads 1, stride 2) [-> BatchNormalization] [-> act] -> y."""
    rng = np.random.default_rng(seed)
    inits = {"W": rng.standard_normal((o, c // group, k, k)).astype(np.float32) * 0.3}
    conv_in = ["x", "W"] + (["B"] * bias)
    if bias:
        inits["B"] = rng.standard_normal(o).astype(np.float32)
    nodes = [helper.make_node("Conv", conv_in, ["c"], name="conv", group=group,
                              kernel_shape=[k, k], pads=[1] * 4, strides=[2, 2])]
    out, inputs, outputs = "c", ["x"], []
    if bn:
        inits.update(s=rng.uniform(0.5, 2, o).astype(np.float32),
                     b=rng.standard_normal(o).astype(np.float32),
                     m=rng.standard_normal(o).astype(np.float32),
                     v=rng.uniform(0.2, 3, o).astype(np.float32))
        nodes.append(helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"],
                                      name="bn", epsilon=1e-3, training_mode=training_mode))
        out = "n"
        if bn_output:
            outputs.append("n")
    if act == "Relu":
        nodes.append(helper.make_node("Relu", [out], ["y"], name="act"))
        out = "y"
    elif act == "Clip":
        lo, hi = clip
        inits["lo"] = np.float32(lo)
        if clip_from_input:
            inputs.append("hi")
        else:
            inits["hi"] = np.float32(hi)
        nodes.append(helper.make_node("Clip", [out, "lo", "hi"], ["y"], name="act"))
        out = "y"
    if extra_user:
        nodes.append(helper.make_node("Neg", ["c"], ["z"], name="other"))
        outputs.append("z")
    return model(nodes, inputs, [out] + outputs, inits, opset=opset)


def _ops_after_rewrite(m):
    return [n.op_type for n in fuse_conv(m.graph, m.opset_import[0].version).node]


@pytest.mark.parametrize("kw, ops", [
    ({}, ["FusedConv"]),
    ({"act": None}, ["FusedConv"]),
    ({"bn": False}, ["FusedConv"]),
    ({"act": "Clip"}, ["FusedConv"]),
    ({"bn": False, "act": None}, ["Conv"]),
    ({"extra_user": True}, ["Conv", "BatchNormalization", "Relu", "Neg"]),  # c read twice
    ({"training_mode": 1}, ["Conv", "BatchNormalization", "Relu"]),  # batch statistics
    ({"bn_output": True}, ["FusedConv", "Relu"]),  # a graph output: the chain stops there
])
def test_which_chains_fuse(kw, ops):
    assert _ops_after_rewrite(_chain(**kw)) == ops


def test_clip_before_opset_11_is_left_as_written():
    m = _chain(act="Clip", bn=False, opset=17)
    assert _ops_after_rewrite(m) == ["FusedConv"]
    assert fuse_conv(m.graph, 10).node[0].op_type == "Conv"


def _run(m, x, fused, extra=()):
    old = os.environ.get("JAXOPS_DISABLE")
    os.environ["JAXOPS_DISABLE"] = "" if fused else "fused_conv"
    try:
        program = load(m)
        out = program.jit()(x, *extra)
        return np.asarray(out[0] if isinstance(out, tuple) else out), program
    finally:
        os.environ.pop("JAXOPS_DISABLE") if old is None else os.environ.update(
            JAXOPS_DISABLE=old)


CHAINS = {
    "bn_relu": {}, "bn_relu_nobias": {"bias": False}, "bn": {"act": None},
    "relu": {"bn": False}, "bn_relu6": {"act": "Clip"}, "clip": {"act": "Clip", "clip": (-0.5, 0.3)},
    "grouped": {"c": 16, "o": 32, "group": 4}, "stem7x7": {"c": 3, "o": 24, "k": 7},
}


@pytest.mark.parametrize("name", CHAINS)
def test_fused_matches_the_nodes_as_written(name):
    m = _chain(**CHAINS[name])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, CHAINS[name].get("c", 8), 9, 9)).astype(np.float32)
    x[1, 0, 4, 4] = np.nan
    got, program = _run(m, x, fused=True)
    want, _ = _run(m, x, fused=False)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).any()
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-5)
    if jax.default_backend() == "cpu":  # the epilogue in the kernel: no pass of its own
        hlo = program.jit().lower(x).compile().as_text()
        assert hlo.count("custom_call_target=\"jaxops_conv_nhwc\"") == 1
        clamps = lambda text: any(op in text for op in (" maximum(", " minimum(", " clamp("))
        assert not clamps(hlo)  # the activation went into the kernel too
        _, unfused = _run(m, x, fused=False)
        assert clamps(unfused.jit().lower(x).compile().as_text()) or name == "bn"


def test_a_moved_forward_shares_its_large_convolutions():
    # program.jit()'s small forward moves to cpu_device(1) at its first call where jax's CPU
    # client runs more than one thread (program.may_move); XLA then runs it on one, and the
    # kernel's large convolutions (a 7x7 stem of 7.4 MFLOP) may take as many threads as jax's
    # client has (cpu.kernel_threads); the same values as the program's unmoved forward
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernel's threads")
    from jaxops.cpu import cpu_device, xla_threads
    from jaxops.onnx.program import may_move
    m = _chain(c=3, o=64, k=7, extra_user=True)  # (XLA counts no FLOPs of a kernel alone)
    x = np.random.default_rng(2).standard_normal((2, 3, 32, 32)).astype(np.float32)
    program = load(m)
    moves = may_move(program.params)
    forward = program.jit()
    got = forward(x)
    assert (forward._device is cpu_device(1)) == moves
    text = forward._fn.lower(jax.device_put(x, forward._device)).as_text()
    threads = xla_threads() if moves else 1
    assert text.count(f"threads = {threads} ") == 1, text.count("threads = ")
    want = jax.jit(program)(program.params, x)  # traced weights: one thread
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_bounds_from_the_data_run_the_nodes_formula():
    m = _chain(act="Clip", clip_from_input=True)
    x = np.random.default_rng(2).standard_normal((2, 8, 9, 9)).astype(np.float32)
    hi = np.float32(0.7)
    got, _ = _run(m, x, fused=True, extra=(hi,))
    want, _ = _run(m, x, fused=False, extra=(hi,))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.max() <= hi


def test_gradients_are_the_unfused_formulas():
    # a fused chain differentiated (its params traced): the replaced nodes' derivatives
    m = _chain()
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 8, 9, 9)), jnp.float32)
    grads = []
    for fused in (True, False):
        os.environ["JAXOPS_DISABLE"] = "" if fused else "fused_conv"
        try:
            program = load(m)
            loss = lambda p: jnp.sum(jnp.sin(program.run(p, x)[0]))
            grads.append(jax.jit(jax.grad(loss))(program.params))
        finally:
            os.environ.pop("JAXOPS_DISABLE")
    for k in grads[0]:
        np.testing.assert_allclose(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-5)


@pytest.mark.ort
@pytest.mark.parametrize("name", ["bn_relu", "bn_relu6", "grouped", "stem7x7"])
def test_fused_matches_onnxruntime(name):
    ort = pytest.importorskip("onnxruntime")
    m = _chain(**CHAINS[name])
    x = np.random.default_rng(4).standard_normal((2, CHAINS[name].get("c", 8), 9, 9)).astype(
        np.float32)
    want = ort.InferenceSession(m.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got, _ = _run(m, x, fused=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"k": 1}, {"act": "Clip"}],
                         ids=["bn_relu", "nobias", "xla_conv_1x1", "bn_relu6"])
def test_constant_batch_norm_folds_into_the_weights(kw):
    # program.jit() closes over the params: the BatchNormalization goes into the weights and
    # one shift (ORT's Conv + BatchNormalization fusion), on the kernel's path and on XLA's;
    # the program then holds two constants for the chain (XLA:CPU allocates each a call)
    m = _chain(**kw)
    x = np.random.default_rng(5).standard_normal((2, 8, 9, 9)).astype(np.float32)
    got, program = _run(m, x, fused=True)
    want, unfused = _run(m, x, fused=False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if jax.default_backend() != "cpu":
        return
    entry = lambda p: p.jit().lower(x).compile().as_text().split("ENTRY")[1]
    assert entry(program).count(" constant(") <= 2 < entry(unfused).count(" constant(")
    # with the params traced (jax.jit(program)(params, x)) the nodes' own math, unfolded
    traced = jax.jit(program)(program.params, x)
    np.testing.assert_allclose(np.asarray(traced[0] if isinstance(traced, tuple) else traced),
                               want, rtol=1e-5, atol=1e-5)
