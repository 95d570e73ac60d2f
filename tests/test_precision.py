"""Mixed precision of imported graphs (`load(..., precision="bf16")`, jaxops/onnx/precision.py):
the per-op rule, the graph's interface kept float32, float32 training state, and losses of real
exports (tests/data/corpus) that track the float32 run within bfloat16's tolerance."""
import collections
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import TensorProto, helper

from jaxops.onnx import load, precision, train_core
from jaxops.onnx.training import CheckpointState, Module, Optimizer
from onnx_build import model, vi

sys.path.insert(0, str(Path(__file__).parent))
from test_corpus import CORPUS, _reference  # noqa: E402

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)
# 5 AdamW steps, bf16 vs f32, largest relative loss difference measured on the CPU
# (2026-11-24): GPT-2/BERT/LLaMA 2.5e-5..5.7e-5, ViT 3.0e-3..4.0e-3, ResNet 5.7e-3
LOSS_RTOL = 1e-2


def _eqns(fn, *args):
    """The equations of fn(*args)'s jaxpr, nested jaxprs' too."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            out.append(e)
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def _dtypes(fn, *args) -> collections.Counter:
    """(primitive, output dtype) -> count over the jaxpr of fn(*args), nested jaxprs too."""
    return collections.Counter((e.primitive.name, str(v.aval.dtype))
                               for e in _eqns(fn, *args) for v in e.outvars)


def _dot_inputs(fn, *args) -> collections.Counter:
    """operand dtype -> count of dot_generals over the jaxpr of fn(*args), nested ones too."""
    return collections.Counter(str(e.invars[0].aval.dtype) for e in _eqns(fn, *args)
                               if e.primitive.name == "dot_general")


def test_rule_per_op_kind():
    p = precision.Policy("bf16")
    x16 = jnp.ones((4, 8), jnp.bfloat16)
    x32, b32 = jnp.ones((4, 8), jnp.float32), np.ones(8, np.float32)
    ids = np.arange(3, dtype=np.int64)
    dt = lambda args: [None if a is None else np.dtype(a.dtype) for a in args]
    # matmul-class: every float operand down, integers untouched
    assert dt(p.inputs("MatMul", [x32, x32])) == [BF16, BF16]
    assert dt(p.inputs("FusedMatMul", [x16, x32])) == [BF16, BF16]
    assert dt(p.inputs("ConvGrad", [x32, x16, x32])) == [BF16, BF16, BF16]
    # sensitive: every float operand up, sequences of the optimizers too
    assert dt(p.inputs("Softmax", [x16])) == [F32]
    assert dt(p.inputs("LayerNormalization", [x16, b32, b32])) == [F32, F32, F32]
    assert dt(p.inputs("ReduceSum", [x16, ids])) == [F32, np.dtype(np.int64)]
    assert dt(p.inputs("SoftmaxCrossEntropyLossGrad", [x16, x16, ids])) == [F32, F32,
                                                                          np.dtype(np.int64)]
    acc = p.inputs("InPlaceAccumulatorV2", [x32, x16, np.ones(1, bool)])
    assert dt(acc[:2]) == [F32, F32]
    opt = p.inputs("AdamWOptimizer", [None, None, [x16], [x32]])
    assert opt[2][0].dtype == F32
    # follow: a bf16 activation keeps bf16 against a smaller f32 operand (bias, scalar)...
    assert dt(p.inputs("Add", [x16, b32])) == [BF16, BF16]
    assert dt(p.inputs("Mul", [np.float32(2.0), x16])) == [BF16, BF16]
    assert dt(p.inputs("Where", [np.ones(8, bool), np.float32(-1e4), x16]))[1:] == [BF16, BF16]
    # ... but meets a full-size f32 operand (the residual stream) in f32
    assert dt(p.inputs("Add", [x32, x16])) == [F32, F32]
    assert dt(p.inputs("Sum", [x16, x32, x16])) == [F32, F32, F32]
    # all-f32 or all-bf16 operands, casts, shapes, Resize's scales: untouched
    assert p.inputs("Add", [x32, b32])[1] is b32
    for op, args in [("Cast", [x16]), ("CastLike", [x32, x16]), ("Shape", [x16])]:
        assert dt(p.inputs(op, args)) == dt(args)
    scales = np.array([1, 1, 1.5, 1.5], np.float32)
    out = p.inputs("Resize", [x16, None, scales])
    assert out[2] is scales
    # a static operand stays numpy (static: Expand's and Reshape's shape readers need that)
    assert isinstance(p.inputs("Add", [x16, b32])[1], np.ndarray)
    # f64 and f16 are never touched
    x64 = np.ones((4, 8))
    assert p.inputs("MatMul", [x64, x64])[0] is x64


def test_precision_choices():
    assert precision.check(None) is None and precision.check("f32") is None
    assert precision.check("bf16") == "bf16" == precision.check("bfloat16")
    with pytest.raises(ValueError, match="loss scaling"):
        precision.check("f16")
    with pytest.raises(ValueError, match="'tf32'"):
        precision.check("tf32")
    m = model([helper.make_node("Relu", ["x"], ["y"])], ["x"], ["y"])
    with pytest.raises(ValueError, match="loss scaling"):
        load(m, precision="f16")


def _mlp():
    """y = Softmax(Gelu(x @ W1 + b1) @ W2) + x, its row sum, a Cast and a Shape."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Gelu", ["hb"], ["g"], domain="com.microsoft"),
             helper.make_node("MatMul", ["g", "w2"], ["z"]),
             helper.make_node("Softmax", ["z"], ["s"], axis=-1),
             helper.make_node("Add", ["s", "x"], ["y"]),
             helper.make_node("ReduceSum", ["y", "axes"], ["r"], keepdims=0),
             helper.make_node("Cast", ["z"], ["zc"], to=TensorProto.FLOAT),
             helper.make_node("Shape", ["z"], ["shape"])]
    inits = {"w1": rng.standard_normal((8, 16)).astype(np.float32),
             "b1": rng.standard_normal(16).astype(np.float32),
             "w2": rng.standard_normal((16, 8)).astype(np.float32) / 4,
             "axes": np.array([1], np.int64)}
    m = model(nodes, [vi("x", shape=[4, 8])],
              [vi("y", shape=[4, 8]), vi("r", shape=[4]), vi("zc", shape=[4, 8]),
               vi("shape", TensorProto.INT64, [2]), vi("g", TensorProto.BFLOAT16, [4, 16])],
              inits, domains=["com.microsoft"])
    return m, rng.standard_normal((4, 8)).astype(np.float32)


def test_graph_runs_matmuls_in_bf16_and_keeps_its_interface():
    m, x = _mlp()
    f32, bf16 = load(m), load(m, precision="bf16")
    assert bf16.precision == "bf16" and f32.precision is None
    run = jax.jit(lambda p, x: bf16.run(p, x))
    y, r, zc, shape, g = run(bf16.params, x)
    # declared float32 outputs come back float32, integer ones untouched; g is declared
    # bf16, so what the policy gave it (bf16: the activation between the matmuls) stays
    assert [np.dtype(v.dtype) for v in (y, r, zc)] == [F32] * 3
    assert shape.dtype == np.int64 or shape.dtype == np.int32
    assert np.dtype(g.dtype) == BF16
    want = f32.run(f32.params, x)
    for got, ref in zip((y, r, zc), want[:3]):
        np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=5e-2, atol=5e-2)
        assert not np.array_equal(np.asarray(got), ref)  # really computed differently
    ops = _dtypes(lambda p, x: bf16.run(p, x), bf16.params, x)
    assert ops[("dot_general", "bfloat16")] == 2 and ops[("dot_general", "float32")] == 0
    assert ops[("exp", "float32")] >= 1 and ops[("exp", "bfloat16")] == 0  # softmax in f32
    assert ops[("reduce_sum", "float32")] >= 1
    assert ops[("add", "bfloat16")] >= 1  # the bias add between the matmuls


def _corpus_losses(name, prec):
    ref, data = _reference(name)
    d = CORPUS / name
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(d / "training_model.onnx", state, precision=prec)
    optimizer = Optimizer(d / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(ref["lr"])
    losses = []
    for step in range(ref["steps"]):
        losses.append(float(module(*[data[f"in_{n}"][step] for n in ref["inputs"]])))
        optimizer.step()
        module.lazy_reset_grad()
    return np.array(losses), state


# all but resnet run their attention fused (handlers/fused_attention.py)
@pytest.mark.parametrize("name", ["gpt2_ts", "bert_dynamo", "llama_ts", "vit_ts", "whisper_ts",
                                  "resnet_ts"])
def test_corpus_losses_track_float32(name):
    want, _ = _corpus_losses(name, None)
    got, state = _corpus_losses(name, "bf16")
    rel = np.abs(got - want) / np.abs(want)
    assert rel.max() <= LOSS_RTOL, f"bf16 losses {got} vs f32 {want}: {rel.max():.2g}"
    assert rel.max() > 1e-7, "bf16 gave the f32 losses: the policy did not act"
    # the checkpoint's state stays float32: parameters, gradients, moments
    ts = state.train_state
    for tree in (ts.params, ts.grads, ts.moments):
        assert {np.dtype(v.dtype) for v in jax.tree.leaves(tree)} == {F32}


def test_jitted_trainer_keeps_float32_state():
    """One jitted, donated Trainer.step in bf16: the state's dtypes and tree are unchanged,
    the matmuls of the step are bf16 and the optimizer's arithmetic f32."""
    name = "gpt2_ts"
    ref, data = _reference(name)
    d = CORPUS / name
    ts = CheckpointState.load_checkpoint(d / "checkpoint").train_state
    model = train_core.TrainingModel(d / "training_model.onnx", ts, precision="bf16")
    opt = train_core.OptimizerModel(d / "optimizer_model.onnx", model)
    assert model.program.precision == "bf16" and opt.program.precision is None
    state = opt.init(model.init(ts))
    trainer = train_core.Trainer(model, opt)
    inputs = [jnp.asarray(data[f"in_{n}"][0]) for n in ref["inputs"]]
    before = jax.tree.map(lambda v: (v.shape, np.dtype(v.dtype)), state)
    ops = _dot_inputs(trainer.step, state, inputs, 1e-3)
    # bf16 operands (the fused attention's score product may return float32 from them)
    assert ops["bfloat16"] > 0 and ops["float32"] == 0
    step = jax.jit(trainer.step, donate_argnums=0)
    (loss, *_), state = step(state, inputs, np.float32(1e-3))
    (loss2, *_), state = step(state, inputs, np.float32(1e-3))
    assert np.dtype(loss.dtype) == F32 and np.isfinite(loss) and loss2 < loss
    assert jax.tree.map(lambda v: (v.shape, np.dtype(v.dtype)), state) == before
    np.testing.assert_allclose(float(loss), data["losses"][0], rtol=1e-3)


def test_eval_program_follows_the_precision():
    d = CORPUS / "gpt2_ts"
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx", precision="bf16")
    assert module.core.eval_program.precision == "bf16"


def test_float64_graphs_are_untouched():
    """Only float32/bfloat16 are cast: a float64 graph computes in float64."""
    m = model([helper.make_node("MatMul", ["a", "b"], ["y"])],
              [vi("a", TensorProto.DOUBLE, [2, 2]), vi("b", TensorProto.DOUBLE, [2, 2])],
              [vi("y", TensorProto.DOUBLE, [2, 2])])
    a = np.array([[1, 1e-9], [0, 1]])
    with jax.enable_x64(True):
        y = load(m, precision="bf16").run(None, a, a)[0]
        assert y.dtype == np.float64 and y[0, 1] == 2e-9


def test_softmax_gradients_run_as_xla_code_under_bf16():
    """precision.XLA: under the bf16 policy SoftmaxGrad_13 lowers XLA's code (which fuses the
    policy's casts), in float32 its kernel; both give the same values."""
    m = model([helper.make_node("SoftmaxGrad_13", ["dy", "y"], ["dx"], domain="com.microsoft",
                                axis=-1)],
              [vi("dy", TensorProto.FLOAT, [4, 32]), vi("y", TensorProto.FLOAT, [4, 32])],
              [vi("dx", TensorProto.FLOAT, [4, 32])], domains=("com.microsoft",))
    rng = np.random.default_rng(0)
    dy = rng.standard_normal((4, 32)).astype(np.float32)
    y = jax.nn.softmax(rng.standard_normal((4, 32)).astype(np.float32))
    text = lambda p: str(jax.make_jaxpr(lambda a, b: p.run(p.params, a, b))(dy, y))
    f32, bf16 = load(m), load(m, precision="bf16")
    assert "jaxops_softmax_grad" in text(f32)
    assert "jaxops_softmax_grad" not in text(bf16)
    np.testing.assert_allclose(bf16.run(bf16.params, dy, y)[0], f32.run(f32.params, dy, y)[0],
                               rtol=1e-6, atol=1e-7)
    # the route is the node's, not the process's: a direct call keeps the kernel
    from jaxops import ops
    direct = str(jax.make_jaxpr(lambda a, b: ops.softmax_grad_13(a, b, axis=-1))(dy, y))
    assert "jaxops_softmax_grad" in direct
