"""Fused attention under precision="bf16" (jaxops/onnx/handlers/fused_attention.py): which
graphs the rewrite fuses, which it leaves alone, and that a fused step computes what the
written-out graph computes, within bfloat16's tolerance."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from jaxops.onnx import load, train_core
from jaxops.onnx import checkpoint as ckpt_format
from jaxops.onnx.handlers.fused_attention import fuse_attention
from onnx_build import model, vi

FIXTURE = Path(__file__).parent / "data" / "transformer"  # 2 layers, pre-norm, no mask
INTERNAL = "jaxops.internal"


def _fused(program) -> list[str]:
    return [s.node.op_type for s in program._main.steps if s.node.domain == INTERNAL]


def _ops(program) -> set[str]:
    return {s.node.op_type for s in program._main.steps}


def test_fixture_graphs_fuse_every_layer():
    """Training graph: a forward and a backward node per layer, no softmax left; eval graph:
    the forwards. Float32 loads are never rewritten."""
    train = onnx.load(str(FIXTURE / "training_model.onnx"))
    prog = load(train, precision="bf16")
    assert sorted(_fused(prog)) == ["FusedAttention"] * 2 + ["FusedAttentionGrad"] * 2
    assert not {"Softmax", "SoftmaxGrad_13"} & _ops(prog)
    assert _fused(load(onnx.load(str(FIXTURE / "eval_model.onnx")), precision="bf16")) == [
        "FusedAttention"] * 2
    assert _fused(load(train)) == []


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("JAXOPS_DISABLE", "fused_attention")
    prog = load(onnx.load(str(FIXTURE / "training_model.onnx")), precision="bf16")
    assert _fused(prog) == [] and "SoftmaxGrad_13" in _ops(prog)


def _attention(scale_node=("Div", "c"), mask=False, axis=-1, probs_out=False):
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"])]
    x = "s"
    if scale_node:
        nodes.append(helper.make_node(scale_node[0], ["s", scale_node[1]], ["x"]))
        x = "x"
    if mask:
        nodes.append(helper.make_node("Add", [x, "m"], ["xm"]))
        x = "xm"
    nodes += [helper.make_node("Softmax", [x], ["a"], axis=axis),
              helper.make_node("MatMul", ["a", "v"], ["o"])]
    shape = [2, 3, 16, 8]
    inputs = [vi("q", TensorProto.FLOAT, shape), vi("kt", TensorProto.FLOAT, [2, 3, 8, 16]),
              vi("v", TensorProto.FLOAT, shape)]
    if mask:
        inputs.append(vi("m", TensorProto.FLOAT, [16, 16]))
    outputs = [vi("o", TensorProto.FLOAT, shape)] + (
        [vi("a", TensorProto.FLOAT, [2, 3, 16, 16])] if probs_out else [])
    inits = {"c": np.float32(np.sqrt(8.0))} if scale_node and scale_node[1] == "c" else {}
    return model(nodes, inputs, outputs, initializers=inits)


@pytest.mark.parametrize("kind", ["mask", "axis", "probs_out"])
def test_other_patterns_are_left_alone(kind):
    """A mask between the scale and the softmax, a softmax over another axis, probabilities
    the graph also returns: not the pattern, run as written."""
    m = _attention(**{"mask": dict(mask=True), "axis": dict(axis=1),
                      "probs_out": dict(probs_out=True)}[kind])
    assert fuse_attention(m.graph, 17) is m.graph
    assert _fused(load(m, precision="bf16")) == []


def _inputs(rng):
    q = rng.standard_normal((2, 3, 16, 8)).astype(np.float32)
    kt = rng.standard_normal((2, 3, 8, 16)).astype(np.float32)
    v = rng.standard_normal((2, 3, 16, 8)).astype(np.float32)
    return q, kt, v


@pytest.mark.parametrize("scale_node", [("Div", "c"), ("Mul", "c"), None])
def test_forward_matches_the_written_out_graph(monkeypatch, scale_node):
    m = _attention(scale_node=scale_node)
    q, kt, v = _inputs(np.random.default_rng(0))
    run = lambda p: np.asarray(jax.jit(lambda *x: p.run(p.params, *x)[0])(q, kt, v))
    fused = load(m, precision="bf16")
    assert _fused(fused) == ["FusedAttention"]
    got = run(fused)
    monkeypatch.setenv("JAXOPS_DISABLE", "fused_attention")
    written = run(load(m, precision="bf16"))
    want = run(load(m))  # float32
    # both bfloat16 runs within bfloat16's tolerance of float32; the fused one (float32 logits)
    # no further from it than the written-out one (bfloat16 logits) beyond rounding
    err, err_written = np.abs(got - want).max(), np.abs(written - want).max()
    assert err <= 3e-2 * np.abs(want).max(), err
    assert err <= 1.5 * err_written + 1e-3, (err, err_written)
    assert not np.array_equal(got, want)  # computed in bfloat16: the policy acted


def test_scale_known_only_at_run_time_runs_the_written_out_formula():
    """c a graph input traced by jit: no static scale for the fused call, the graph's formula
    (same values as the unfused bf16 graph)."""
    m = _attention(scale_node=("Div", "cin"))
    m.graph.input.append(vi("cin", TensorProto.FLOAT, []))
    q, kt, v = _inputs(np.random.default_rng(1))
    c = np.float32(3.0)
    p = load(m, precision="bf16")
    assert _fused(p) == ["FusedAttention"]
    got = jax.jit(lambda *x: p.run(p.params, *x)[0])(q, kt, v, c)
    want = load(m).run(None, q, kt, v, c)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=5e-2, atol=5e-2)


def test_handler_errors_name_the_problem():
    from jaxops.onnx.handlers.fused_attention import _attend
    q = jnp.ones((2, 4, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="rank"):
        _attend(q, jnp.ones((2, 8), jnp.bfloat16), q, np.float32(2.0), "Div", "node n")
    with pytest.raises(ValueError, match="divided by 0"):
        _attend(q, jnp.ones((2, 8, 4), jnp.bfloat16), q, np.float32(0.0), "Div", "node n")


def test_training_step_tracks_the_written_out_graph(monkeypatch):
    """The fixture's training step in bf16, fused vs written out: the loss and every gradient
    within bfloat16's tolerance (the backward node's gradients are the graph's)."""
    state = train_core.TrainState.from_checkpoint(ckpt_format.load(FIXTURE / "checkpoint"))
    data = np.load(FIXTURE / "data.npz")
    inputs = [data["inputs"][0], data["labels"][0]]

    def step():
        tm = train_core.TrainingModel(FIXTURE / "training_model.onnx", state, precision="bf16")
        ts = tm.init(state)
        outs, new = jax.jit(tm.train_step)(ts, inputs)
        return tm, outs, new

    tm, outs, new = step()
    assert sorted(_fused(tm.program)).count("FusedAttentionGrad") == 2
    monkeypatch.setenv("JAXOPS_DISABLE", "fused_attention")
    _, outs2, new2 = step()
    np.testing.assert_allclose(float(outs[0]), float(outs2[0]), rtol=1e-2)
    for name, g in new.grads.items():
        g2 = np.asarray(new2.grads[name], np.float32)
        scale = np.abs(g2).max() + 1e-6
        assert np.abs(np.asarray(g, np.float32) - g2).max() <= 5e-2 * scale, name
