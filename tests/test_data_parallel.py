"""Data-parallel training of an imported ORT training graph (tests/data/mlp) over forced CPU
devices equals the single-device step on the full batch; examples/data_parallel.py runs, in
one process and in two processes joined by jax.distributed."""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import on_cpu_devices, world

from jaxops.onnx.data_parallel import DataParallel
from jaxops.onnx.training import CheckpointState, Module, Optimizer

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "tests" / "data" / "mlp"
LR = 0.05


def _trainer(mesh=None):
    state = CheckpointState.load_checkpoint(MLP / "checkpoint")
    module = Module(MLP / "training_model.onnx", state, device=None)
    optimizer = Optimizer(MLP / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(LR)
    return state, module, optimizer


def test_data_parallel_steps_equal_single_device_steps():
    data = np.load(MLP / "data.npz")
    xs, ys = data["inputs"][:2], data["labels"][:2]  # two steps of the full batch of 8
    state1, module, optimizer = _trainer()
    single = []
    for x, y in zip(xs, ys):
        single.append(float(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
    state4, module4, optimizer4 = _trainer()
    n = world(4)  # 4 shards of 2 samples on the CPU
    if n < 2 or 8 % n:
        pytest.skip(f"the batch of 8 does not split over {n} devices")
    mesh = jax.sharding.Mesh(np.array(on_cpu_devices(n)), ("data",))
    trainer = DataParallel(module4, optimizer4, mesh)
    parallel = [float(trainer.step(x, y)) for x, y in zip(xs, ys)]
    initial = CheckpointState.load_checkpoint(MLP / "checkpoint").parameters
    np.testing.assert_allclose(parallel, single, rtol=1e-6)
    ts1, ts4 = state1.train_state, state4.train_state
    assert ts4.step == ts1.step == 2
    for name in ts1.grads:  # the last step's gradient: the all-reduced mean
        np.testing.assert_allclose(ts4.grads[name], ts1.grads[name], rtol=1e-5,
                                   atol=1e-7, err_msg=name)
    # Adam moves each weight by up to lr a step whatever the gradient's size, so a gradient
    # near zero that the all-reduce rounds differently moves its weight by a fraction of lr
    # (4 H200s: 4.3e-7 off at one element); a wrong step is off by lr itself.
    for name in state1.parameters:
        p4 = ts4.param(name)
        assert p4.sharding.is_fully_replicated and len(p4.sharding.device_set) == n
        np.testing.assert_allclose(p4, ts1.param(name), rtol=1e-5, atol=1e-4 * LR,
                                   err_msg=name)
        assert not np.allclose(p4, initial[name].data), f"{name} did not train"
    for name, moments in ts1.moments.items():
        for k in moments:
            np.testing.assert_allclose(ts4.moments[name][k], moments[k], rtol=1e-5,
                                       atol=1e-9, err_msg=f"{name} {k}")


def test_step_is_one_shard_map_with_an_all_reduce():
    _, module, optimizer = _trainer()
    mesh = jax.sharding.Mesh(np.array(on_cpu_devices(2)), ("data",))
    trainer = DataParallel(module, optimizer, mesh)
    data = np.load(MLP / "data.npz")
    args = (module.state.train_state, np.float32(0.05),
            [jax.device_put(v, trainer.batch_sharding)
             for v in (data["inputs"][0], data["labels"][0])])
    hlo = trainer.step_fn.lower(*args).compile().as_text()
    assert re.search(r"all-reduce(-start)?\(", hlo)


def test_bad_use():
    _, module, optimizer = _trainer()
    mesh = jax.sharding.Mesh(np.array(on_cpu_devices(3)), ("data",))
    trainer = DataParallel(module, optimizer, mesh)
    data = np.load(MLP / "data.npz")
    with pytest.raises(ValueError, match="must divide over 3 devices"):
        trainer.step(data["inputs"][0], data["labels"][0])
    with pytest.raises(TypeError, match="expected 2 inputs"):
        trainer.step(data["inputs"][0])
    with pytest.raises(ValueError, match="no axis 'data'"):
        DataParallel(module, optimizer, jax.sharding.Mesh(np.array(on_cpu_devices(2)), ("x",)))
    _, other, _ = _trainer()
    with pytest.raises(ValueError, match="another Module"):
        DataParallel(other, optimizer, mesh)


def _losses(text):
    return [float(v) for v in re.findall(r"^step \d+ loss ([\d.]+)$", text, re.MULTILINE)]


def _env(devices):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_example_runs_in_one_and_in_two_processes():
    example = [sys.executable, str(ROOT / "examples" / "data_parallel.py"), "--steps", "3"]
    one = subprocess.run(example, env=_env(4), capture_output=True, text=True, timeout=120,
                         check=False)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "4 device(s) in 1 process(es)" in one.stdout
    single = _losses(one.stdout)
    assert len(single) == 3 and all(np.isfinite(single))
    port = str(_free_port())
    procs = [subprocess.Popen([*example, "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i)], env=_env(2),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    assert "4 device(s) in 2 process(es)" in outs[0]
    # 2 processes x 2 devices train exactly as 1 process x 4 devices
    assert _losses(outs[0]) == single and _losses(outs[1]) == []  # process 1 prints nothing
