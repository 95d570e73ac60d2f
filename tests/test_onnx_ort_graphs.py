"""Graphs made by ORT's own training tools (onnxruntime.training.artifacts.generate_artifacts):
training_model.onnx (com.microsoft gradient ops, InPlaceAccumulatorV2), eval_model.onnx and
optimizer_model.onnx (AdamWOptimizer over sequence-typed graph inputs).

Each loads, or fails with the one error listing only com.microsoft ops that ORT_OPS lacks so
far (then the test skips and says which). Where it loads, the results are checked: the loss
against onnxruntime, the accumulated gradients against jax.grad of the eval model, the AdamW
step against its formula (ORT's adam_mode=1)."""
import os
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper

from jaxops.onnx import OnnxImportError, load

ort = pytest.importorskip("onnxruntime")


def _artifacts_module():
    """onnxruntime.training.artifacts without the package __init__, which imports torch."""
    if "onnxruntime.training" not in sys.modules:
        pkg = types.ModuleType("onnxruntime.training")
        pkg.__path__ = [os.path.join(os.path.dirname(ort.__file__), "training")]
        sys.modules["onnxruntime.training"] = pkg
    try:
        from onnxruntime.training import artifacts
    except ImportError as e:
        pytest.skip(f"onnxruntime.training.artifacts unavailable: {e}")
    return artifacts


@pytest.fixture(scope="module")
def artifacts_dir(tmp_path_factory):
    artifacts = _artifacts_module()
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(size=3).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]),
         helper.make_node("Add", ["xw", "b"], ["h"]),
         helper.make_node("Relu", ["h"], ["logits"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3])], [w, b])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    out = tmp_path_factory.mktemp("artifacts")
    artifacts.generate_artifacts(m, requires_grad=["w", "b"],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=out)
    return out, numpy_helper.to_array(w), numpy_helper.to_array(b)


def _load_or_skip(path):
    try:
        return load(path)
    except OnnxImportError as e:
        # the only acceptable failure: ops whose handlers are not delivered yet
        assert "unsupported op(s)" in str(e), str(e)
        missing = re.findall(r"\('([^']*)', '([^']*)', \d+\)", str(e))
        pytest.skip(f"{os.path.basename(path)}: no handler yet for {sorted(missing)}")


def _inputs(rng):
    return rng.normal(size=(2, 4)).astype(np.float32), np.array([0, 2], np.int64)


def test_eval_model_matches_onnxruntime(artifacts_dir, rng):
    out, w, b = artifacts_dir
    p = _load_or_skip(str(out / "eval_model.onnx"))
    x, labels = _inputs(rng)
    feeds = {"x": x, "labels": labels, "w": w, "b": b}
    want = ort.InferenceSession(str(out / "eval_model.onnx"),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(jax.jit(p)(p.params, **feeds), want, rtol=1e-5)


def test_training_model_loss_and_accumulated_gradients(artifacts_dir, rng):
    out, w, b = artifacts_dir
    train = _load_or_skip(str(out / "training_model.onnx"))
    evaluate = _load_or_skip(str(out / "eval_model.onnx"))
    x, labels = _inputs(rng)
    buffers = {"w_grad.accumulation.buffer": np.ones_like(w),
               "b_grad.accumulation.buffer": np.ones_like(b)}
    feeds = {"x": x, "labels": labels, "w": w, "b": b, **buffers,
             "lazy_reset_grad": np.array([False])}
    outputs, updates = jax.jit(train.run_with_updates)(train.params, **feeds)
    want = ort.InferenceSession(str(out / "training_model.onnx"),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(outputs[0], want[0], rtol=1e-5)  # the loss
    grads = jax.grad(lambda w, b: evaluate(evaluate.params, x=x, labels=labels, w=w, b=b),
                     argnums=(0, 1))(w, b)
    # lazy_reset_grad false: the buffers accumulate onto their old contents (ones)
    np.testing.assert_allclose(updates["w_grad.accumulation.buffer"], 1 + grads[0], rtol=1e-5)
    np.testing.assert_allclose(updates["b_grad.accumulation.buffer"], 1 + grads[1], rtol=1e-5)


def test_optimizer_model_adamw_step(artifacts_dir, rng):
    out, w, b = artifacts_dir
    p = _load_or_skip(str(out / "optimizer_model.onnx"))
    params = [w, b]
    grads = [rng.normal(size=v.shape).astype(np.float32) for v in params]
    m1 = [rng.normal(size=v.shape).astype(np.float32) for v in params]
    m2 = [np.abs(rng.normal(size=v.shape)).astype(np.float32) for v in params]
    lr, step = np.array([0.01], np.float32), np.array([3], np.int64)
    _, updates = jax.jit(p.run_with_updates)(
        p.params, learning_rate=lr, step=step, params=params, gradients=grads,
        first_order_moments=m1, second_order_moments=m2)
    a, bt, eps = 0.9, 0.999, 1e-6  # generate_artifacts' AdamW: adam_mode=1, weight_decay=0
    for i in range(2):
        n1 = a * m1[i] + (1 - a) * grads[i]
        n2 = bt * m2[i] + (1 - bt) * grads[i] ** 2
        new_w = params[i] - lr[0] * np.sqrt(1 - bt ** 3) / (1 - a ** 3) * n1 / (np.sqrt(n2) + eps)
        np.testing.assert_allclose(updates["params"][i], new_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(updates["first_order_moments"][i], n1, rtol=1e-5)
        np.testing.assert_allclose(updates["second_order_moments"][i], n2, rtol=1e-5)
    assert isinstance(updates["params"], list) and jnp.shape(updates["params"][0]) == w.shape
