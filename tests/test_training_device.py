"""Module's device: JAX's default device unless asked, ORT's names ('cpu', 'cuda', 'cuda:N') or
a jax.Device otherwise, and a clear error for a device this JAX does not have."""
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("onnx")
from jaxops.onnx.training import CheckpointState, Module  # noqa: E402

MLP = Path(__file__).parent / "data" / "mlp"


def _module(**kwargs):
    state = CheckpointState.load_checkpoint(MLP / "checkpoint")
    return state, Module(MLP / "training_model.onnx", state, **kwargs)


def _devices(state):
    return {d for p in jax.tree.leaves(state.train_state) if isinstance(p, jax.Array)
            for d in p.devices()}


def test_default_is_jax_default_device():
    state, module = _module()
    data = np.load(MLP / "data.npz")
    loss = module(data["inputs"][0], data["labels"][0])
    assert loss.devices() == {jax.devices()[0]}
    assert _devices(state) == {jax.devices()[0]}


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
