"""Small CPU programs wait for their results by polling (jaxops.onnx.program.polls): which
programs do, that program.jit() and the ORT-API Module/Optimizer apply it, and that results are
ready when such a call returns."""
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

pytest.importorskip("onnx")
from onnx import TensorProto, helper
from onnx_build import model, vi

import jaxops
from jaxops.onnx import load, program
from jaxops.onnx.training import CheckpointState, Module, Optimizer

DATA = Path(__file__).parent / "data"
CPU = jax.devices()[0].platform == "cpu"
MULTICORE = len(os.sched_getaffinity(0)) > 1 if hasattr(os, "sched_getaffinity") else True


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _slow_small(x):
    # XLA's cost analysis counts one loop iteration: ~2 kFLOP (above XLA:CPU's 1000, under
    # which it runs a call inline) that run for ~3 ms
    return lax.fori_loop(0, 1000, lambda i, y: jnp.sin(y) + 1e-3, x)


X = np.zeros(2048, np.float32)


@pytest.mark.skipif(not CPU, reason="polling is for CPU programs")
def test_which_programs_poll(monkeypatch):
    x = np.ones(16, np.float32)
    assert program.polls(_compiled(lambda x: x + 1, x)) is MULTICORE
    big = np.ones((512, 512), np.float32)  # 268 MFLOP: above POLL_MAX_FLOPS
    assert not program.polls(_compiled(lambda a, b: a @ b, big, big))
    monkeypatch.setattr(program, "POLL_MAX_FLOPS", 1)
    assert not program.polls(_compiled(lambda x: x * 2 + 1, x))
    monkeypatch.setattr(program, "POLL_MAX_FLOPS", 2 ** 25)
    monkeypatch.setattr(program.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert not program.polls(_compiled(lambda x: x + 1, x))  # one core: nothing to spare


@pytest.mark.skipif(not CPU, reason="polling is for CPU programs")
def test_wait_polling_returns_with_the_results_ready():
    f = jax.jit(_slow_small)
    jax.block_until_ready(f(X))
    plain = [f(X) for _ in range(3)]
    assert not all(o.is_ready() for o in plain)  # async dispatch: what the polling is for
    out = f(X)
    program.wait_polling(out, seconds=10.0)
    assert out.is_ready()
    program.wait_polling([out, 3, None])  # non-arrays are skipped


def _add_one():
    node = helper.make_node("Add", ["x", "one"], ["y"])
    return model([node], [vi("x", TensorProto.FLOAT, [4, 3])], [vi("y", TensorProto.FLOAT, [4, 3])],
                 initializers={"one": np.ones((4, 3), np.float32)})


@pytest.mark.skipif(not CPU, reason="polling is for CPU programs")
def test_program_jit_polls_small_forwards(patient, monkeypatch):
    p = load(_add_one())
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    forward = p.jit()
    assert isinstance(forward, program.PollingJit) and forward._polls is None
    monkeypatch.setattr(program, "xla_threads", lambda device=None: 1)  # stays (_moves below)
    y = p.jit()(x)
    monkeypatch.undo()
    moves = MULTICORE and program.xla_threads() > 1
    y = forward(x)
    # a small program moves to cpu_device(1) (where results are ready on return), or polls
    assert forward._polls is (MULTICORE and not moves) and y.is_ready()
    assert y.devices() == {jaxops.cpu_device(1) if moves else jax.devices()[0]}
    np.testing.assert_array_equal(y, x + 1)
    # the jitted function's own attributes, and transformations of the wrapper
    assert len(jax.tree_util.tree_leaves(forward.lower(x).args_info)) == 1
    fresh = p.jit()
    np.testing.assert_array_equal(jax.jit(fresh)(x), x + 1)
    np.testing.assert_array_equal(jax.vmap(fresh)(np.stack([x, x])), np.stack([x, x]) + 1)
    assert fresh._polls is None  # traced only: decided at a real call


@pytest.mark.skipif(not CPU or not MULTICORE, reason="a CPU with XLA's threads")
def test_program_jit_moves_small_forwards_to_one_thread(monkeypatch):
    """program.jit() of a small forward with its params on jax's default device runs on
    cpu_device(1) from its first call, inputs placed elsewhere moved there; a larger one
    stays."""
    if program.xla_threads() < 2:
        pytest.skip("the default client runs one thread")
    p = load(_add_one())
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    one, home = jaxops.cpu_device(1), jax.devices()[0]
    forward = p.jit()
    assert [forward(x).devices() for _ in range(2)] == [{one}, {one}]
    np.testing.assert_array_equal(forward(x), x + 1)
    np.testing.assert_array_equal(forward(x=jax.device_put(x, home)), x + 1)
    assert forward(jax.device_put(x, home)).devices() == {one}  # positional: moved too
    monkeypatch.setattr(program, "POLL_MAX_FLOPS", 0)
    assert p.jit()(x).devices() == {home}
    # which params may move: host ones and those on jax's default device, not others
    arr = np.ones(300, np.float32)
    assert program.may_move({"a": arr, "b": jax.device_put(arr, home)})
    if len(jax.devices()) > 1:
        assert not program.may_move({"a": jax.device_put(arr, jax.devices()[1])})
    monkeypatch.setattr(program, "xla_threads", lambda device=None: 1)
    assert not program.may_move({"a": arr})


@pytest.fixture
def patient(monkeypatch):
    """Polls that give up after 10 s rather than POLL_SECONDS: on a loaded CI machine (every core
    running a test worker) a 3 ms program can take longer than 10 ms, and a poll that gave up
    left its result unready (a flake seen in .ci/run, 2026-11-27)."""
    monkeypatch.setattr(program, "POLL_SECONDS", 10.0)


@pytest.mark.skipif(not CPU, reason="polling is for CPU programs")
def test_polling_jit_waits_for_its_results(patient):
    polled = program.PollingJit(jax.jit(_slow_small))
    jax.block_until_ready(polled(X))
    assert polled._polls is MULTICORE
    if MULTICORE:
        assert all(polled(X).is_ready() for _ in range(3))


def test_polling_jit_remakes_its_function_for_the_first_calls_arguments():
    """program.jit() on a one-thread CPU: jit_options read the first call's jaxpr (its matmuls'
    sizes), so the function is made again for that call's arguments, once; not for a call
    under a transformation (no arguments to run)."""
    made = []

    def remake(args, kwargs):
        made.append((args, kwargs))
        return jax.jit(lambda x: x * 3)
    f = program.PollingJit(jax.jit(lambda x: x * 2), remake=remake)
    assert float(jax.jit(f)(1.0)) == 2.0 and made == []  # traced: the function as given
    assert float(f(1.0)) == 3.0 and float(f(2.0)) == 6.0
    assert made == [((1.0,), {})]


@pytest.mark.skipif(not CPU, reason="polling is for CPU programs")
def test_module_eval_and_optimizer_step_poll_train_step_does_not_wait(patient):
    """A train step alone is not waited for (an optimizer step follows it); the optimizer
    step issued with the next train step, or alone before an eval call, and the eval call are
    (each polls where small, as ORT's calls return when done)."""
    d = DATA / "mlp"
    data = np.load(d / "data.npz")
    x, y = data["inputs"][0], data["labels"][0]
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx", device="cpu")
    optimizer = Optimizer(d / "optimizer_model.onnx", module)
    module(x, y)  # the train step: decided, not waited for
    assert list(module._steps._polls.values()) == [MULTICORE]
    assert module._queued_small is MULTICORE
    optimizer.step()  # waits for the next train call
    assert optimizer._steps._polls == {} and state._pending is optimizer
    module.lazy_reset_grad()
    loss = module(x, y)  # the update and the train step in one program
    assert state._pending is None
    assert list(optimizer._steps._polls.values()) == [MULTICORE]
    if MULTICORE:
        assert loss.is_ready()
        assert all(b.is_ready() for b in state._packed.trained.values())
    optimizer.step()
    module.eval()
    out = module(*[x, y][:len(module.input_names())])  # the update alone, then eval
    assert list(optimizer._steps._polls.values()) == [MULTICORE, MULTICORE]
    assert module._queued_small
    assert list(module._steps._polls.values()) == [MULTICORE, MULTICORE]
    if MULTICORE:
        assert all(o.is_ready() for o in jax.tree_util.tree_leaves(out))
