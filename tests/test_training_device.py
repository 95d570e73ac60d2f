"""Module's device: JAX's default device unless asked (on a CPU with XLA's threads, a small
model's Module moves to a one-thread client at its first call), ORT's names ('cpu', 'cuda',
'cuda:N') or a jax.Device otherwise, and a clear error for a device this JAX does not have."""
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("onnx")
import jaxops  # noqa: E402
from jaxops.cpu import xla_threads  # noqa: E402
from jaxops.onnx import program, training  # noqa: E402
from jaxops.onnx.training import CheckpointState, Module, Optimizer  # noqa: E402

MLP = Path(__file__).parent / "data" / "mlp"


def _module(**kwargs):
    state = CheckpointState.load_checkpoint(MLP / "checkpoint")
    return state, Module(MLP / "training_model.onnx", state, **kwargs)


def _devices(state):
    return {d for p in jax.tree.leaves(state.train_state) if isinstance(p, jax.Array)
            for d in p.devices()}


def _moves():
    """Whether a default-placed small Module moves to cpu_device(1) at its first call."""
    return jax.default_backend() == "cpu" and xla_threads() > 1


def test_default_is_jax_default_device():
    state, module = _module()
    data = np.load(MLP / "data.npz")
    loss = module(data["inputs"][0], data["labels"][0])
    want = jaxops.cpu_device(1) if _moves() else jax.devices()[0]
    assert loss.devices() == {want}
    assert _devices(state) == {want}


@pytest.mark.parametrize("device", [None, "cpu", "CPU"])
@pytest.mark.parametrize("eval_first", [False, True])
def test_small_default_placed_module_moves_to_one_thread(device, eval_first):
    """A small model's Module on jax's default CPU client (XLA's threads) moves to
    cpu_device(1) at its first train call (an eval call first moves its eval step alone);
    values as where it was, its optimizer's steps too."""
    if not _moves():
        pytest.skip("the default client runs one thread (or no CPU default)")
    data = np.load(MLP / "data.npz")
    x, y = data["inputs"][0], data["labels"][0]
    state, module = _module(device=device, eval_model_uri=MLP / "eval_model.onnx")
    _, staying = _module(device=jax.devices()[0], eval_model_uri=MLP / "eval_model.onnx")
    assert _devices(state) == {jax.devices()[0]}  # not before its first call
    for m in (module, staying):
        m.train(not eval_first)
    got, want = module(x, y), staying(x, y)
    assert _devices(state) == {jax.devices()[0] if eval_first else jaxops.cpu_device(1)}
    assert got.devices() == {jaxops.cpu_device(1)}
    assert staying._at.device is jax.devices()[0] and want.devices() == {jax.devices()[0]}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    steps = [Optimizer(MLP / "optimizer_model.onnx", m) for m in (module, staying)]
    for m in (module, staying):
        m.train()
    for _ in range(3):  # the optimizer steps where the moved Module's state now is
        np.testing.assert_allclose(float(module(x, y)), float(staying(x, y)), rtol=1e-5)
        for m, opt in zip((module, staying), steps):
            opt.step()
            m.lazy_reset_grad()
    assert _devices(state) == {jaxops.cpu_device(1)}


def test_what_keeps_a_module_where_it_is(monkeypatch):
    """No move: an explicit device, a step above SMALL_FLOPS, an optimizer step before the
    module's first call, a default client of one thread."""
    if not _moves():
        pytest.skip("the default client runs one thread (or no CPU default)")
    data = np.load(MLP / "data.npz")
    x, y = data["inputs"][0], data["labels"][0]
    home = jax.devices()[0]
    for device in (home, f"cpu:{home.id}"):
        state, module = _module(device=device)
        module(x, y)
        assert _devices(state) == {home}
    state, module = _module()
    Optimizer(MLP / "optimizer_model.onnx", module).step()
    module(x, y)
    assert _devices(state) == {home}
    with monkeypatch.context() as m:
        m.setattr(training, "SMALL_FLOPS", 0)
        state, module = _module()
        module(x, y)
        assert _devices(state) == {home}
    monkeypatch.setattr(program, "xla_threads", lambda device=None: 1)
    state, module = _module()
    module(x, y)
    assert _devices(state) == {home}


@pytest.mark.parametrize("train_cost, moves", [(100.0, True), (1000.0, False)])
def test_each_step_kind_is_placed_by_its_own_count(monkeypatch, train_cost, moves):
    """An eval call first places the eval step alone, by its own count, once; the Module's
    place (its state, its train and eval steps) waits for the first train call's count."""
    if not _moves():
        pytest.skip("the default client runs one thread (or no CPU default)")
    data = np.load(MLP / "data.npz")
    x, y = data["inputs"][0], data["labels"][0]
    monkeypatch.setattr(training, "SMALL_FLOPS", 500)
    costs, counted = iter([100.0, train_cost]), []  # the eval step's count, then the train's
    monkeypatch.setattr(training, "cost", lambda stage: counted.append(stage) or
                        (next(costs), 0.0))
    home, one = jax.devices()[0], jaxops.cpu_device(1)
    state, module = _module(eval_model_uri=MLP / "eval_model.onnx")
    _, staying = _module(device=home, eval_model_uri=MLP / "eval_model.onnx")
    for _ in range(2):
        got, want = module.eval()(x, y), staying.eval()(x, y)
        assert got.devices() == {one} and _devices(state) == {home}
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    assert len(counted) == 1
    for m in (module, staying):
        m.train()(x, y)
    assert len(counted) == 2 and _devices(state) == {one if moves else home}
    got, want = module.eval()(x, y), staying.eval()(x, y)
    assert got.devices() == {one}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    assert (module._eval_at is None) == moves  # a moved Module's eval step is its own
    assert len(counted) == 2


@pytest.mark.parametrize("eval_cost, moves", [(100.0, True), (1000.0, False)])
def test_a_pool_modules_small_eval_step_runs_on_one_thread(monkeypatch, eval_cost, moves):
    """A Module whose train step stays on XLA's pool runs an eval step of at most SMALL_FLOPS
    on cpu_device(1), with a copy of the parameters made again after each train step: the
    values of a Module that stays, the state where it was."""
    if not _moves():
        pytest.skip("the default client runs one thread (or no CPU default)")
    data = np.load(MLP / "data.npz")
    x, y = data["inputs"][0], data["labels"][0]
    monkeypatch.setattr(training, "SMALL_FLOPS", 500)
    costs = iter([1000.0, eval_cost])  # the train step's count first, then the eval step's
    monkeypatch.setattr(training, "cost", lambda stage: (next(costs), 0.0))
    home = jax.devices()[0]
    state, module = _module(eval_model_uri=MLP / "eval_model.onnx")
    _, staying = _module(device=home, eval_model_uri=MLP / "eval_model.onnx")
    pairs = [(m, Optimizer(MLP / "optimizer_model.onnx", m)) for m in (module, staying)]
    for step in range(3):
        for m, opt in pairs:
            m.train()
            m(x, y)
            opt.step()
            m.lazy_reset_grad()
        got, want = (m.eval()(x, y) for m, _ in pairs)
        assert got.devices() == {jaxops.cpu_device(1) if moves else home}, step
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(module(x, y)), np.asarray(got))
    assert _devices(state) == {home}


def test_ort_device_name():
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:  # JAX_PLATFORMS=cuda
        pytest.skip("jax has no CPU backend here")
    state, _ = _module(device=f"cpu:{len(cpus) - 1}")
    assert _devices(state) == {cpus[-1]}


@pytest.mark.parametrize("name", ["cuda:99"] + (["cuda"] if jax.default_backend() == "cpu" else []))
def test_missing_device_is_a_clear_error(name):
    with pytest.raises(ValueError, match=f"device '{name}': jax has no such device.*device=None"):
        _module(device=name)


def test_steps_place_inputs_without_device_put(monkeypatch):
    """With a device, numpy inputs go straight to the jitted steps (a jax.device_put of them
    first cost 90-170 us a step on a CPU), and an array on another device is moved."""
    cpus = jax.devices("cpu") if jax.default_backend() == "cpu" else []
    if len(cpus) < 2:
        pytest.skip("needs two CPU devices (conftest forces 8)")
    state, module = _module(device=f"cpu:{len(cpus) - 1}")
    data = np.load(MLP / "data.npz")
    x, y = data["inputs"][0], data["labels"][0]
    want = float(_module()[1](x, y))
    with monkeypatch.context() as m:
        m.setattr(jax, "device_put", None)  # any call of it fails
        loss = module(x, y)
    assert float(loss) == want
    assert loss.devices() == {cpus[-1]} and _devices(state) == {cpus[-1]}
    loss = module(jax.device_put(x, cpus[0]), y)  # the parameters have not moved: same loss
    assert float(loss) == want and loss.devices() == {cpus[-1]}
    assert _devices(state) == {cpus[-1]}
