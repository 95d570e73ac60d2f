"""Fused attention (jaxops/onnx/handlers/fused_attention.py), under precision="bf16" and for
float32 graphs on a GPU: which graphs the rewrite fuses, which it leaves alone, and that a fused
step computes what the written-out graph computes, within the precision's tolerance."""
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
    # float32: rewritten on a GPU only (its flash attention); elsewhere the graph as written
    gpu = jax.default_backend() == "gpu"
    assert sorted(_fused(load(train))) == (sorted(_fused(prog)) if gpu else [])


def test_a_fused_qkv_projection_is_passed_packed():
    """The fixture's attention reads Q, K and V as thirds of one QKV projection (Split ->
    Reshape -> Transpose): both fused nodes also take that projection's output, and the
    backward node produces its gradient itself, in place of ORT's Transposes, Reshapes and
    Concat (which it no longer leaves to run)."""
    graph = onnx.load(str(FIXTURE / "training_model.onnx")).graph
    split_inputs = {n.input[0] for n in graph.node if n.op_type == "Split"}
    concats = {n.output[0]: n for n in graph.node if n.op_type == "Concat"}
    fused = fuse_attention(graph, 17)
    nodes = {n.op_type: [] for n in fused.node}
    for n in fused.node:
        nodes[n.op_type].append(n)
    assert len(nodes["FusedAttention"]) == len(nodes["FusedAttentionGrad"]) == 2
    for fwd, bwd in zip(nodes["FusedAttention"], nodes["FusedAttentionGrad"]):
        assert fwd.input[5] in split_inputs and bwd.input[6] == fwd.input[5]
        assert [a.i for a in bwd.attribute if a.name == "packed"] == [1]
        (grad,) = bwd.output
        assert grad in concats  # the Concat's output, now made by the fused node
    left = {n.output[0] for n in fused.node if n.op_type == "Concat"}
    assert not left & {bwd.output[0] for bwd in nodes["FusedAttentionGrad"]}


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("JAXOPS_DISABLE", "fused_attention")
    prog = load(onnx.load(str(FIXTURE / "training_model.onnx")), precision="bf16")
    assert _fused(prog) == [] and "SoftmaxGrad_13" in _ops(prog)


def _attention(scale_node=("Div", "c"), mask=False, axis=-1, probs_out=False, dropout=False):
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"])]
    x = "s"
    if scale_node:
        nodes.append(helper.make_node(scale_node[0], ["s", scale_node[1]], ["x"]))
        x = "x"
    if mask:
        nodes.append(helper.make_node("Add", [x, "m"], ["xm"]))
        x = "xm"
    nodes.append(helper.make_node("Softmax", [x], ["a"], axis=axis))
    if dropout:
        nodes.append(helper.make_node("Dropout", ["a"], ["ad"]))
    nodes.append(helper.make_node("MatMul", ["ad" if dropout else "a", "v"], ["o"]))
    shape = [2, 3, 16, 8]
    inputs = [vi("q", TensorProto.FLOAT, shape), vi("kt", TensorProto.FLOAT, [2, 3, 8, 16]),
              vi("v", TensorProto.FLOAT, shape)]
    if mask:
        inputs.append(vi("m", TensorProto.FLOAT, [2, 1, 1, 16]))  # a padding mask
    outputs = [vi("o", TensorProto.FLOAT, shape)] + (
        [vi("a", TensorProto.FLOAT, [2, 3, 16, 16])] if probs_out else [])
    scale = np.sqrt(8.0) if scale_node and scale_node[0] == "Div" else 1 / np.sqrt(8.0)
    inits = {"c": np.float32(scale)} if scale_node and scale_node[1] == "c" else {}
    return model(nodes, inputs, outputs, initializers=inits)


@pytest.mark.parametrize("kind", ["dropout", "axis", "probs_out"])
def test_other_patterns_are_left_alone(kind):
    """Dropout on the probabilities, a softmax over another axis, probabilities the graph also
    returns: not the pattern, run as written."""
    m = _attention(**{"dropout": dict(dropout=True), "axis": dict(axis=1),
                      "probs_out": dict(probs_out=True)}[kind])
    assert fuse_attention(m.graph, 17) is m.graph
    assert _fused(load(m, precision="bf16")) == []


def _inputs(rng):
    q = rng.standard_normal((2, 3, 16, 8)).astype(np.float32)
    kt = rng.standard_normal((2, 3, 8, 16)).astype(np.float32)
    v = rng.standard_normal((2, 3, 16, 8)).astype(np.float32)
    return q, kt, v


@pytest.mark.parametrize("scale_node,mask", [(("Div", "c"), False), (("Mul", "c"), False),
                                             (None, False), (("Mul", "c"), True)])
def test_forward_matches_the_written_out_graph(monkeypatch, scale_node, mask):
    m = _attention(scale_node=scale_node, mask=mask)
    q, kt, v = _inputs(np.random.default_rng(0))
    # the padding mask: the last 5 keys of the second sequence hidden (HF's finfo.min)
    extra = [np.where(np.arange(16) >= 11, np.finfo(np.float32).min, 0).astype(np.float32)
             * np.array([0, 1], np.float32).reshape(2, 1, 1, 1)] if mask else []
    run = lambda p: np.asarray(jax.jit(lambda *x: p.run(p.params, *x)[0])(q, kt, v, *extra))
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


def test_scale_known_only_at_run_time_is_folded_into_q():
    """c a graph input traced by jit (as an initializer passed as an argument is): no static
    scale for the fused kernels, so on a GPU Q is scaled first; the values of the unfused bf16
    graph (on the CPU, its formula)."""
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


@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_training_step_tracks_the_written_out_graph(monkeypatch, precision):
    """The fixture's training step, fused vs written out: the loss and every gradient within
    the precision's tolerance (the backward node's gradients are the graph's). Float32 graphs
    are fused on a GPU only (seq 8 there: the written-out fallback)."""
    if precision == "f32" and jax.default_backend() != "gpu":
        pytest.skip("float32 graphs are fused on a GPU only")
    tol = 1e-2 if precision == "bf16" else 1e-3
    state = train_core.TrainState.from_checkpoint(ckpt_format.load(FIXTURE / "checkpoint"))
    data = np.load(FIXTURE / "data.npz")
    inputs = [data["inputs"][0], data["labels"][0]]

    def step():
        tm = train_core.TrainingModel(FIXTURE / "training_model.onnx", state,
                                      precision=precision)
        ts = tm.init(state)
        outs, new = jax.jit(tm.train_step)(ts, inputs)
        return tm, outs, new

    tm, outs, new = step()
    assert sorted(_fused(tm.program)).count("FusedAttentionGrad") == 2
    monkeypatch.setenv("JAXOPS_DISABLE", "fused_attention")
    _, outs2, new2 = step()
    np.testing.assert_allclose(float(outs[0]), float(outs2[0]), rtol=tol)
    for name, g in new.grads.items():
        g2 = np.asarray(new2.grads[name], np.float32)
        scale = np.abs(g2).max() + 1e-6
        assert np.abs(np.asarray(g, np.float32) - g2).max() <= 5 * tol * scale, name


@pytest.mark.parametrize("name", ["gpt2_ts", "gpt2_dynamo"])
def test_gpt2_packed_qkv_gradients_match_the_written_out_graph(monkeypatch, name):
    """GPT-2's c_attn split in three (both exporters; dynamo's Reshapes have allowzero=1):
    both layers pass the projection packed, and the bf16 step's loss and gradients match the
    written-out graph's (the backward node's packed gradient is the Concat it replaced)."""
    from test_corpus import CORPUS, _reference

    from jaxops.onnx.training import CheckpointState
    ref, data = _reference(name)
    d = CORPUS / name
    graph = onnx.load(str(d / "training_model.onnx")).graph
    packed = [n for n in fuse_attention(graph, 17).node if n.op_type == "FusedAttentionGrad"
              and any(a.name == "packed" and a.i for a in n.attribute)]
    assert len(packed) == 2
    state = CheckpointState.load_checkpoint(d / "checkpoint").train_state
    inputs = [data[f"in_{n}"][0] for n in ref["inputs"]]

    def step():
        tm = train_core.TrainingModel(d / "training_model.onnx", state, precision="bf16")
        return jax.jit(tm.train_step)(tm.init(state), inputs)

    outs, new = step()
    monkeypatch.setenv("JAXOPS_DISABLE", "fused_attention")
    outs2, new2 = step()
    np.testing.assert_allclose(float(outs[0]), float(outs2[0]), rtol=1e-2)
    for key, g in new.grads.items():
        g2 = np.asarray(new2.grads[key], np.float32)
        assert np.abs(np.asarray(g, np.float32) - g2).max() <= 5e-2 * (np.abs(g2).max() + 1e-6), key


def _f32_formula(q, kt, v, scale):
    with jax.default_matmul_precision("float32"):
        p = jax.nn.softmax(jnp.matmul(q, kt) * scale, axis=-1)
        return jnp.matmul(p, v)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the flash attention runs on a GPU")
@pytest.mark.parametrize("shape", [(2, 3, 128, 32), (1, 2, 192, 64), (4, 256, 16)])
@pytest.mark.parametrize("matmul", ["tensorfloat32", "float32"])
def test_float32_flash_attention_on_a_gpu(shape, matmul):
    """Float32 operands on a GPU take the flash attention (T a multiple of 64, power-of-2 head
    sizes): forward and gradients against the float32 formula, within TF32's tolerance, or
    float32's when the matmul precision asks for it."""
    from jaxops.onnx.handlers.fused_attention import _attend_vjp, _flash_f32
    rng = np.random.default_rng(4)
    q, v, do = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    kt = np.swapaxes(rng.standard_normal(shape).astype(np.float32), -1, -2)
    q4 = jnp.asarray(q if q.ndim == 4 else q[None])
    assert _flash_f32(q4, q4, q4, 0.2) is not None  # the kernel, not the fallback

    def fused(q, kt, v, do):
        with jax.default_matmul_precision(matmul):
            o, vjp = _attend_vjp(q, kt, v, np.float32(0.2), "Mul", "node n", None)
            return o, *vjp(do)
    got = jax.jit(fused)(q, kt, v, do)
    o, vjp = jax.vjp(lambda *x: _f32_formula(*x, 0.2), q, kt, v)
    tol = 1e-2 if matmul == "tensorfloat32" else 1e-4
    for g, w in zip(got, (o, *vjp(do))):
        w = np.asarray(w)
        assert np.abs(np.asarray(g) - w).max() <= tol * np.abs(w).max()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the flash attention runs on a GPU")
def test_float32_flash_attention_reads_the_packed_projection():
    """A [B, T, 3D] QKV projection goes to the kernel as it is; the attention's gradient in it
    matches the float32 formula's (TF32 tolerance)."""
    from jaxops.onnx.handlers.fused_attention import _attend_vjp, _packed_operand
    b, t, n, h = 2, 128, 3, 32
    rng = np.random.default_rng(5)
    qkv = jnp.asarray(rng.standard_normal((b, t, 3 * n * h)).astype(np.float32))
    do = jnp.asarray(rng.standard_normal((b, n, t, h)).astype(np.float32))

    def thirds(x):
        q, k, v = (p.reshape(b, t, n, h) for p in jnp.split(x, 3, axis=-1))
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    assert _packed_operand(qkv, *thirds(qkv), np.float32(0.2), "Mul", "n", None) is not None

    def fused(x, do):
        o, vjp = _attend_vjp(*thirds(x), np.float32(0.2), "Mul", "node n", None, x)
        return o, *vjp(do)
    o, dqkv = jax.jit(fused)(qkv, do)
    want, vjp = jax.vjp(lambda x: _f32_formula(*thirds(x), 0.2), qkv)
    for g, w in ((o, want), (dqkv, vjp(do)[0])):
        w = np.asarray(w)
        assert np.abs(np.asarray(g) - w).max() <= 1e-2 * np.abs(w).max()


def test_float32_fallback_keeps_the_softmax_grad_kernel():
    """Where the flash attention does not apply (here: the CPU), a float32 backward runs the
    written-out formula with ORT's SoftmaxGrad_13 (as the unfused graph does); bf16 keeps
    XLA's softmax gradient, which fuses the policy's casts."""
    from jaxops.onnx.handlers.fused_attention import _attend_vjp
    q, kt, v = _inputs(np.random.default_rng(5))

    def grads(dtype):
        x = [jnp.asarray(a, dtype) for a in (q, kt, v)]
        o, vjp = _attend_vjp(*x, np.float32(2.0), "Div", "node n", None)
        return vjp(o)
    f32, b16 = (str(jax.make_jaxpr(grads, static_argnums=0)(d)) for d in (jnp.float32,
                                                                        jnp.bfloat16))
    assert "softmax_grad_13" in f32.lower() and "softmax_grad_13" not in b16.lower()


def _training_attention(bias_grad: bool):
    """Forward MatMul -> Mul(c) -> Add(bias) -> Softmax -> MatMul and its gradient as ORT's
    builder writes it (FusedMatMuls around SoftmaxGrad_13); bias_grad: the bias is trained,
    so ReduceSum reads the softmax gradient too."""
    fmm = lambda a, b, o, ta, tb: helper.make_node("FusedMatMul", [a, b], [o],
                                                    domain="com.microsoft", transA=ta, transB=tb,
                                                    alpha=1.0)
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "c"], ["x"]),
             helper.make_node("Add", ["x", "b"], ["xb"]),
             helper.make_node("Softmax", ["xb"], ["a"], axis=-1),
             helper.make_node("MatMul", ["a", "v"], ["o"]),
             fmm("a", "do", "dv", 1, 0), fmm("do", "v", "da", 0, 1),
             helper.make_node("SoftmaxGrad_13", ["da", "a"], ["dxb"], domain="com.microsoft",
                              axis=-1),
             helper.make_node("Identity", ["dxb"], ["dx"]),
             helper.make_node("Mul", ["dx", "c"], ["ds"]),
             fmm("ds", "kt", "dq", 0, 1), fmm("q", "ds", "dkt", 1, 0)]
    outputs = ["o", "dq", "dkt", "dv"]
    if bias_grad:
        nodes.append(helper.make_node("ReduceSum", ["dxb"], ["db"], keepdims=0))
        outputs.append("db")
    shapes = {"q": [2, 3, 16, 8], "kt": [2, 3, 8, 16], "v": [2, 3, 16, 8], "do": [2, 3, 16, 8],
              "b": [1, 1, 16, 16]}
    return model(nodes, [vi(n, TensorProto.FLOAT, sh) for n, sh in shapes.items()],
                 [vi(n, TensorProto.FLOAT) for n in outputs],
                 initializers={"c": np.float32(0.35)}, domains=("com.microsoft",))


def test_a_trained_bias_keeps_the_written_out_gradient():
    m = _training_attention(bias_grad=True)
    assert fuse_attention(m.graph, 17) is m.graph


def test_backward_node_gives_the_gradients_of_the_forward():
    """The fused pair against jax.grad of the float32 formula: O and dQ, dK^T, dV within
    bfloat16's tolerance."""
    m = _training_attention(bias_grad=False)
    p = load(m, precision="bf16")
    assert sorted(_fused(p)) == ["FusedAttention", "FusedAttentionGrad"]
    rng = np.random.default_rng(3)
    q, kt, v = _inputs(rng)
    do = rng.standard_normal((2, 3, 16, 8)).astype(np.float32)
    b = np.triu(np.full((16, 16), -1e9, np.float32), 1).reshape(1, 1, 16, 16)  # causal
    got = jax.jit(lambda *x: p.run(p.params, *x))(q, kt, v, do, b)

    def f(q, kt, v):
        probs = jax.nn.softmax(jnp.matmul(q, kt) * 0.35 + b, axis=-1)
        return jnp.matmul(probs, v)
    o, vjp = jax.vjp(f, q, kt, v)
    for g, w in zip(got, (o, *vjp(do))):
        w = np.asarray(w)
        assert np.abs(np.asarray(g, np.float32) - w).max() <= 3e-2 * np.abs(w).max()


def test_probabilities_read_by_a_subgraph_are_left_alone():
    """A value an If branch reads by name is used outside the pattern."""
    m = _attention()
    branch = helper.make_graph([helper.make_node("Identity", ["a"], ["r"])], "then", [],
                               [vi("r", TensorProto.FLOAT)])
    m.graph.node.append(helper.make_node("If", ["flag"], ["r_out"], then_branch=branch,
                                         else_branch=branch))
    m.graph.input.append(vi("flag", TensorProto.BOOL, []))
    m.graph.output.append(vi("r_out", TensorProto.FLOAT))
    assert fuse_attention(m.graph, 17) is m.graph


def test_a_bias_made_by_a_matmul_is_ambiguous_and_left_alone():
    """Add(MatMul, MatMul * c): either side could be the scores; nothing is fused."""
    m = _attention(scale_node=("Mul", "c"))
    add = helper.make_node("Add", ["x", "pb"], ["xb"])
    nodes = [n for n in m.graph.node]
    nodes.insert(2, helper.make_node("MatMul", ["pq", "pk"], ["pb"]))
    nodes.insert(3, add)
    nodes[4].input[0] = "xb"  # the Softmax reads the sum
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    m.graph.input.extend([vi("pq", TensorProto.FLOAT, [16, 4]), vi("pk", TensorProto.FLOAT, [4, 16])])
    assert [n.op_type for n in m.graph.node][:5] == ["MatMul", "Mul", "MatMul", "Add", "Softmax"]
    assert fuse_attention(m.graph, 17) is m.graph
