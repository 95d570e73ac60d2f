"""jaxops.onnx.train_core directly: the TrainState pytree and the pure step functions under
jit, a whole step and a jitted loop of steps equal to the ORT-API classes' steps, donation,
for ORT's artifacts (tests/data/mlp) and a forward-only model (jax.grad path)."""
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from jaxops.onnx import artifacts
from jaxops.onnx import checkpoint as C
from jaxops.onnx.train_core import OptimizerModel, Trainer, TrainingModel, TrainState
from jaxops.onnx.training import CheckpointState, Module, Optimizer

MLP = Path(__file__).parent / "data" / "mlp"
LR = 0.05
STEPS = 3


def _forward_artifacts():
    """A forward model (HardSwish: ORT has no gradient for it), AdamW, cross-entropy."""
    r = np.random.default_rng(0)
    w = {"w1": r.normal(size=(8, 16)).astype(np.float32) / 3,
         "w2": r.normal(size=(16, 5)).astype(np.float32) / 4}
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]),
         helper.make_node("HardSwish", ["h"], ["a"]),
         helper.make_node("MatMul", ["a", "w2"], ["y"])],
        "forward", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])],
        [numpy_helper.from_array(v, k) for k, v in w.items()])
    forward = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    art = artifacts.generate_artifacts(forward, requires_grad=["w1"], frozen_params=["w2"],
                                       loss=artifacts.LossType.CrossEntropyLoss,
                                       optimizer=artifacts.OptimType.AdamW)
    return art.training_model, art.eval_model, art.optimizer_model, art.checkpoint


def _mlp_artifacts():
    return (MLP / "training_model.onnx", MLP / "eval_model.onnx",
            MLP / "optimizer_model.onnx", C.load(MLP / "checkpoint"))


def _batches(kind):
    if kind == "mlp":
        data = np.load(MLP / "data.npz")
        return [[x, y] for x, y in zip(data["inputs"][:STEPS], data["labels"][:STEPS])]
    r = np.random.default_rng(1)
    return [[r.normal(size=(6, 8)).astype(np.float32), r.integers(0, 5, 6).astype(np.int64)]
            for _ in range(STEPS)]


ARTIFACTS = {"mlp": _mlp_artifacts, "forward": _forward_artifacts}


@pytest.fixture(params=sorted(ARTIFACTS))
def kind(request):
    return request.param


def _core(kind):
    train, evaluate, opt, ckpt = ARTIFACTS[kind]()
    state = TrainState.from_checkpoint(ckpt)
    model = TrainingModel(train, state, evaluate)
    optimizer = OptimizerModel(opt, model)
    return optimizer.init(model.init(state)), Trainer(model, optimizer)


def _classes(kind):
    """ORT's API over the same artifacts: the losses and the final state of STEPS steps."""
    train, evaluate, opt, ckpt = ARTIFACTS[kind]()
    state = CheckpointState(ckpt)
    module = Module(train, state, evaluate)
    optimizer = Optimizer(opt, module)
    optimizer.set_learning_rate(LR)
    losses = []
    for batch in _batches(kind):
        losses.append(float(module(*batch)))
        optimizer.step()
        module.lazy_reset_grad()
    return losses, state.train_state


def _assert_states_equal(ours, theirs, rtol=1e-5):
    # the classes' packed train step is another XLA program: 1 f32 ulp in a loss on an H100,
    # which 3 AdamW steps lift to 8e-6 of a weight
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert int(ours.step) == int(theirs.step) == STEPS
    for path, a in jax.tree_util.tree_leaves_with_path(ours):
        b = theirs
        for key in path:
            b = getattr(b, key.name) if hasattr(key, "name") else b[key.key]
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_state_is_a_pytree():
    state, trainer = _core("forward")
    leaves, treedef = jax.tree.flatten(state)
    back = jax.tree.unflatten(treedef, leaves)
    assert isinstance(back, TrainState) and back.params.keys() == {"w1"}
    assert back.frozen.keys() == {"w2"} and back.grads.keys() == {"w1"}
    assert back.moments["w1"].keys() == {"momentum0", "momentum1"}
    # 1 param + 1 frozen + 1 grad + 2 moments + step
    assert len(leaves) == 6
    doubled = jax.tree.map(lambda x: x * 2, state)
    np.testing.assert_array_equal(doubled.param("w2"), 2 * state.param("w2"))
    assert trainer.training.trained == ["w1"] and trainer.optimizer.names == ["w1"]


def test_whole_step_under_jit_equals_the_classes(kind):
    state, trainer = _core(kind)
    step = jax.jit(trainer.step, donate_argnums=0)
    losses = []
    for batch in _batches(kind):
        (loss, *_), state = step(state, batch, np.float32(LR))
        losses.append(float(loss))
    their_losses, theirs = _classes(kind)
    np.testing.assert_allclose(losses, their_losses, rtol=1e-6)
    _assert_states_equal(state, theirs)


def test_jitted_loop_of_steps_equals_the_classes(kind):
    state, trainer = _core(kind)
    batches = _batches(kind)
    stacked = [np.stack(xs) for xs in zip(*batches)]
    loop = jax.jit(trainer.steps, donate_argnums=0)
    (losses, *_), state = loop(state, stacked, np.full(STEPS, LR, np.float32))
    their_losses, theirs = _classes(kind)
    np.testing.assert_allclose(losses, their_losses, rtol=1e-6)
    _assert_states_equal(state, theirs, rtol=1e-5)


def test_pure_train_step_accumulates_until_reset(kind):
    state, trainer = _core(kind)
    train = jax.jit(trainer.training.train_step)
    a, b = _batches(kind)[:2]
    _, first = train(state, a, False)
    _, second = train(state, b, True)
    _, both = train(first, b, False)
    for p, g in both.grads.items():
        np.testing.assert_allclose(g, first.grads[p] + second.grads[p], rtol=1e-5, atol=1e-7)
    # the inputs were not donated: still there, unchanged
    np.testing.assert_array_equal(state.grads[p], np.zeros_like(g))


def test_eval_step_equals_module_eval(kind):
    state, trainer = _core(kind)
    train, evaluate, _, ckpt = ARTIFACTS[kind]()
    module = Module(train, CheckpointState(ckpt), evaluate).eval()
    batch = _batches(kind)[0]
    ours = jax.jit(trainer.training.eval_step)(state, batch)
    np.testing.assert_allclose(ours[0], module(*batch), rtol=1e-6)


def test_donated_state_is_reused():
    """Donating the state aliases every buffer the step rewrites: the old arrays are gone,
    and jax reports no donated buffer it could not use."""
    state, trainer = _core("mlp")
    old = jax.tree.leaves(state.replace(step=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable"
        _, new = jax.jit(trainer.step, donate_argnums=0)(state, _batches("mlp")[0],
                                                         np.float32(LR))
    assert all(x.is_deleted() for x in old)
    assert int(new.step) == 1 and not any(x.is_deleted() for x in jax.tree.leaves(new))


def test_optimizer_update_counts_steps_from_the_state():
    """AdamW runs the 1-based step after state.step, which update advances: resuming at
    step k is the same as having taken k steps."""
    state, trainer = _core("forward")
    update = jax.jit(trainer.optimizer.update)
    grads = jax.tree.map(jnp.ones_like, state.grads)
    after_one = update(state.replace(grads=grads), LR)
    assert int(after_one.step) == 1
    at_five = update(state.replace(grads=grads, step=np.int64(4)), LR)
    assert int(at_five.step) == 5
    # bias correction differs between step 1 and step 5
    assert not np.allclose(at_five.params["w1"], after_one.params["w1"])


def test_trainer_refuses_an_optimizer_of_another_model():
    _, trainer = _core("mlp")
    _, other = _core("mlp")
    with pytest.raises(ValueError, match="another training model"):
        Trainer(trainer.training, other.optimizer)


def test_classes_share_the_core():
    """The ORT-API classes hold a TrainState and the core objects, and keep the step count on
    the host (reading it never waits for the device)."""
    train, evaluate, opt, ckpt = _mlp_artifacts()
    state = CheckpointState(ckpt)
    module = Module(train, state, evaluate)
    optimizer = Optimizer(opt, module)
    assert isinstance(module.core, TrainingModel) and optimizer.core.training is module.core
    module(*_batches("mlp")[0])
    optimizer.step()
    assert isinstance(state.train_state, TrainState)
    assert isinstance(state.train_state.step, np.integer) and state.train_state.step == 1
