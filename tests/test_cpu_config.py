"""jaxops.configure_cpu: XLA:CPU's threads for small models (jaxops/cpu.py), and the ORT-API
Module's session_options that map onto it. Its settings act when jax creates its CPU client, so
the effect is checked in fresh processes: the number of threads the process runs, the dispatch
mode and a computation's result."""
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from helpers import fresh_process

_PROBE = textwrap.dedent("""
    import json, os, sys
    import jaxops
    jaxops.configure_cpu({threads})
    import jax, jax.numpy as jnp
    y = jax.jit(lambda x: x @ x)(jnp.ones((64, 64)))
    print(json.dumps({{"threads": len(os.listdir("/proc/self/task")), "y": float(y[0, 0]),
                      "async": jax.config.read("jax_cpu_enable_async_dispatch"),
                      "nproc": os.environ.get("PJRT_NPROC")}}))
""")


def _probe(threads):
    return json.loads(fresh_process(_PROBE.format(threads=threads)).strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_one_thread_runs_fewer_threads_and_calls_inline():
    one, many, default = _probe(1), _probe(8), _probe(None)
    assert one["y"] == many["y"] == default["y"] == 64.0
    assert (one["nproc"], one["async"]) == ("1", False)
    assert (many["nproc"], many["async"]) == ("8", True)  # only threads=1 turns dispatch inline
    assert (default["nproc"], default["async"]) == (None, True)  # None changes nothing
    assert one["threads"] < many["threads"]  # the pool sizes took effect


def test_after_the_backends_started_it_is_an_error():
    jax.devices()  # this test process's backends are running
    with pytest.raises(RuntimeError, match="configure_cpu"):
        jaxops.configure_cpu(1)
    jaxops.configure_cpu(None)  # nothing asked: nothing to refuse


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_are_clear_errors(threads):
    with pytest.raises(ValueError, match="configure_cpu: threads"):
        jaxops.configure_cpu(threads)


# ORT's Module(train, state, eval, device, session_options): its intra_op_num_threads
_ARTIFACTS = Path(__file__).resolve().parent / "data" / "mlp"


@pytest.fixture
def needs_cpu():
    try:  # in the test, not at collection: that would start jax's backends
        jax.devices("cpu")
    except RuntimeError:  # JAX_PLATFORMS=cuda
        pytest.skip("jax has no CPU backend here")


def _module(options, device="cpu"):
    from jaxops.onnx.training import CheckpointState, Module
    state = CheckpointState.load_checkpoint(_ARTIFACTS / "checkpoint")
    return Module(str(_ARTIFACTS / "training_model.onnx"), state,
                  str(_ARTIFACTS / "eval_model.onnx"), device, options)


@pytest.mark.usefixtures("needs_cpu")
def test_session_options_give_the_module_a_client_of_its_own():
    """ORT's intra_op_num_threads, after jax started (loading the checkpoint starts it): the
    Module's state and steps on jaxops.cpu_device(n), one client a count; values as on jax's
    default device."""
    from jaxops.cpu import xla_threads

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = _module(SimpleNamespace(intra_op_num_threads=1))
    assert one._at.device is jaxops.cpu_device(1)
    assert one._at.device.client is not jax.devices("cpu")[0].client
    assert _module(SimpleNamespace(intra_op_num_threads=1))._at.device is one._at.device
    three = _module(SimpleNamespace(intra_op_num_threads=3))
    assert three._at.device.client not in (one._at.device.client, jax.devices("cpu")[0].client)
    assert xla_threads(one._at.device) == 1 and xla_threads(three._at.device) == 3
    default = _module(None, device=jax.devices("cpu")[0])  # stays on jax's CPU client
    data = np.load(_ARTIFACTS / "data.npz")
    for m in (one, three, default):
        m.eval()
    x, y = data["inputs"][0], data["labels"][0]
    want = np.asarray(default(x, y))
    for m in (one, three):
        got = m(x, y)
        assert got.devices() == {m._at.device}
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    one.train()
    assert np.isfinite(float(one(x, y)))
    params = one.state.train_state.params
    assert all(x.devices() == {one._at.device} for x in params.values())
    # jaxops' CPU kernels run one thread where XLA's client has the cores (the session's);
    # a Module that moved to cpu_device(1) by itself traces its steps with the process's count
    from jaxops.cpu import kernel_threads, traced_with_kernel_threads
    assert one._at.kernel_threads == three._at.kernel_threads == default._at.kernel_threads == 1
    moving = _module(None)
    moving(x, y)
    assert moving._at.device is jaxops.cpu_device(1) and moving._at.kernel_threads == xla_threads()
    seen = []
    jax.jit(traced_with_kernel_threads(lambda v: seen.append(kernel_threads()) or v, 3))(1.0)
    assert seen == [3] and kernel_threads() == 1


def test_cpu_device_runs_calls_on_the_calling_thread():
    """threads=1: no async dispatch, so a call's result is ready when it returns."""
    dev = jaxops.cpu_device(1)
    x = jax.device_put(np.ones((256, 256), np.float32), dev)
    f = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
    assert all(f(x).is_ready() for _ in range(20))
    np.testing.assert_allclose(np.asarray(f(x)), np.full((256, 256), 256 * np.tanh(256.0)),
                               rtol=1e-5)


@pytest.mark.parametrize("threads", [0, -2, 1.0, True, "2"])
def test_cpu_device_bad_counts_are_clear_errors(threads):
    with pytest.raises(ValueError, match="cpu_device: threads"):
        jaxops.cpu_device(threads)


@pytest.mark.usefixtures("needs_cpu")
def test_default_session_options_say_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _module(SimpleNamespace(intra_op_num_threads=0))  # ORT's default: every core
        _module(None)


@pytest.mark.usefixtures("needs_cpu")
@pytest.mark.parametrize("threads", [-1, 1.5, "1"])
def test_bad_session_options_are_clear_errors(threads):
    with pytest.raises(ValueError, match="intra_op_num_threads"):
        _module(SimpleNamespace(intra_op_num_threads=threads))


def test_session_options_configured_first_are_quiet():
    # a fresh process: configure_cpu first, then ORT's script unchanged
    script = textwrap.dedent(f"""
        import warnings
        warnings.simplefilter("error", RuntimeWarning)
        import jaxops
        jaxops.configure_cpu(threads=1)
        from types import SimpleNamespace
        from jaxops.onnx.training import CheckpointState, Module
        state = CheckpointState.load_checkpoint({str(_ARTIFACTS / "checkpoint")!r})
        m = Module({str(_ARTIFACTS / "training_model.onnx")!r}, state, None, "cpu",
                   SimpleNamespace(intra_op_num_threads=1))
        import jax
        assert m._at.device is jax.devices("cpu")[0]  # the process's client already runs one
        print("ok")
    """)
    assert fresh_process(script).strip().endswith("ok")


def test_session_options_leave_a_gpu_module_on_the_gpu():
    """intra_op_num_threads sizes ORT's CPU pool: a Module on the GPU stays there."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a GPU as jax's default device")
    module = _module(SimpleNamespace(intra_op_num_threads=1), device=None)
    data = np.load(_ARTIFACTS / "data.npz")
    loss = module(data["inputs"][0], data["labels"][0])
    assert loss.devices() == {jax.devices()[0]}


@pytest.mark.usefixtures("needs_cpu")
@pytest.mark.ort
def test_ort_session_options_themselves():
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _module(options)  # ORT's default: 0, every core
    options.intra_op_num_threads = 1
    assert _module(options)._at.device is jaxops.cpu_device(1)


_SCHEDULE = textwrap.dedent("""
    import os, sys
    import jaxops
    jaxops.configure_cpu({threads})
    import jax, jax.numpy as jnp

    def f(x):  # four independent chains: the two schedulers order them differently
        return sum(jnp.sin(jnp.sin(x @ x + i) @ x) for i in range(4))

    text = jax.jit(f).lower(jnp.ones((32, 32))).compile().as_text()
    print(os.environ.get("XLA_FLAGS", ""))
    print(text[text.index("ENTRY"):].replace("\\n", " "))
""")


def _schedule(xla_flags, threads, disable="unroll_cap"):
    """(XLA_FLAGS after importing jaxops and configure_cpu(threads), the compiled entry
    computation) in a fresh process, with JAXOPS_DISABLE=`disable` (by default the
    scheduler's flag alone: cap_llvm_unroll's is tested below)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env["JAXOPS_DISABLE"] = disable
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    out = subprocess.run([sys.executable, "-c", _SCHEDULE.format(threads=threads)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    flags, entry = out.stdout.rstrip("\n").split("\n")[-2:]
    return flags, entry


def test_import_picks_the_memory_scheduler_unless_told_otherwise():
    """`import jaxops` (and configure_cpu) pick XLA:CPU's memory-minimizing scheduler; not
    with JAXOPS_DISABLE=memory_scheduler or over a user's own setting of the flag."""
    flag = "--xla_cpu_enable_concurrency_optimized_scheduler"
    off = "unroll_cap,memory_scheduler"
    flags, imported = _schedule(None, None)
    assert flags == f"{flag}=false"
    assert _schedule(None, 1) == (flags, imported)
    _, default = _schedule(None, None, off)
    assert _schedule(f"{flag}=false", None, off)[1] == imported != default  # it took effect
    assert _schedule(None, 1, off) == ("", default)
    # a user's own setting stays, and so do other flags
    assert _schedule(f"{flag}=true", 2) == (f"{flag}=true", default)
    assert _schedule("--xla_cpu_use_thunk_runtime=true", None)[0] == (
        f"--xla_cpu_use_thunk_runtime=true {flag}=false")


_UNROLL = textwrap.dedent("""
    import json, os, sys
    if sys.argv[1] == "started":
        import jax
        jax.devices()
    import jax, jax.numpy as jnp
    import jaxops
    x = jnp.arange(512 * 16, dtype=jnp.float32).reshape(512, 16) / 1000
    y = jax.jit(lambda x: jnp.maximum(x * 1.5 - 2.0, 0.0).sum(-1))(x)
    print(json.dumps({"flags": os.environ.get("XLA_FLAGS", ""), "y": y.tolist(),
                      "ref": (x * 1.5 - 2.0).clip(0).sum(-1).tolist(),
                      "measured": jaxops._src.compat.jax_release_in(jaxops.cpu._UNROLL_JAX)}))
""")


def _unroll(when="fresh"):
    return json.loads(fresh_process(_UNROLL, when).strip().splitlines()[-1])


def test_import_caps_llvm_unrolling_where_measured(monkeypatch):
    """`import jaxops` caps LLVM's full unrolling (XLA_FLAGS) for the jax releases measured
    faster with it, before the backends start; never over a user's own setting, after the
    backends started, or with JAXOPS_DISABLE=unroll_cap. The programs compute the same."""
    from jaxops.cpu import _UNROLL_FLAG
    monkeypatch.setenv("JAXOPS_DISABLE", "memory_scheduler")  # this flag alone
    fresh = _unroll()
    assert fresh["flags"] == (_UNROLL_FLAG if fresh["measured"] else "")
    np.testing.assert_allclose(fresh["y"], fresh["ref"], rtol=1e-6)
    assert _unroll("started")["flags"] == ""
    with monkeypatch.context() as env:
        env.setenv("JAXOPS_DISABLE", "unroll_cap,memory_scheduler")
        assert _unroll()["flags"] == ""
    own = "--xla_backend_extra_options=-unroll-full-max-count=4"
    # (fresh_process drops XLA_FLAGS from its environment: the user's flags come in the script)
    script = f"import os; os.environ['XLA_FLAGS'] = {own!r}\n" + _UNROLL
    out = json.loads(fresh_process(script, "fresh").strip().splitlines()[-1])
    assert out["flags"] == own
    np.testing.assert_allclose(out["y"], out["ref"], rtol=1e-6)


_STEPS = textwrap.dedent("""
    import json, os, resource, sys
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import jaxops
    jaxops.configure_cpu(1)
    import numpy as np
    from jaxops.onnx.training import CheckpointState, Module, Optimizer
    counts = {}
    for d in sys.argv[1:]:
        ref = json.load(open(f"{d}/reference.json"))
        data = np.load(f"{d}/reference.npz")
        inputs = [data[f"in_{n}"][0] for n in ref["inputs"]]
        state = CheckpointState.load_checkpoint(f"{d}/checkpoint")
        module = Module(f"{d}/training_model.onnx", state, None, "cpu")
        optimizer = Optimizer(f"{d}/optimizer_model.onnx", module)
        def step():
            module(*inputs); optimizer.step(); module.lazy_reset_grad()
            state.block_until_ready()
        for _ in range(3):
            step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        for _ in range(30):
            step()
        counts[d] = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    print(json.dumps(counts))
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="binds itself to one core")
def test_one_thread_train_steps_run_on_the_calling_thread():
    """On one core with configure_cpu(1), an ORT-API train step of the corpus never waits for
    another thread (a voluntary context switch): jit_options' single-threaded Eigen kernels
    (llama_ts: its weight gradients' matmuls went to XLA's pool thread, 1 switch a step) and
    the gradients added in the flat buffers (bert_ts: 21 additions ready at once, which XLA's
    executor split with that thread, 3 a step)."""
    corpus = Path(__file__).resolve().parent / "data" / "corpus"
    out = fresh_process(_STEPS, *(str(corpus / m) for m in ("llama_ts", "bert_ts")), timeout=300)
    counts = json.loads(out.strip().splitlines()[-1])
    assert all(n <= 3 for n in counts.values()), counts  # (30 steps: 30 and 90 before)


def test_one_thread_forward_is_made_for_its_first_call():
    """program.jit() under configure_cpu(1): its first call makes the forward again with
    jit_options read from that call's jaxpr (MobileNetV3's small matmuls: XLA's dots), and it
    computes what the program does."""
    script = textwrap.dedent("""
        import sys
        import jax
        import numpy as np
        import jaxops
        jaxops.configure_cpu(threads=1)
        from jaxops.onnx import load
        program = load(sys.argv[1])
        x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
        forward = program.jit()
        got = forward(x)
        assert forward._remake is None
        np.testing.assert_allclose(np.asarray(got), np.asarray(program(program.params, x)),
                                   rtol=1e-5, atol=1e-6)
        print("ok")
    """)
    corpus = Path(__file__).resolve().parent / "data" / "corpus"
    assert fresh_process(script, str(corpus / "mobilenetv3_ts" / "forward.onnx")).strip().endswith("ok")


def test_largest_dot_flops_looks_into_nested_jaxprs():
    from jaxops.cpu import largest_dot_flops

    def f(p, a, b, c):
        inner = jax.jit(lambda x, y: jnp.einsum("bij,bjk->bik", x, y))
        branch = jax.lax.cond(p, lambda: a @ b, lambda: jnp.zeros(a.shape[:1] + b.shape[1:]))
        return inner(c, jnp.ones((3, 6, 7))), branch
    small = (True, jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((3, 5, 6)))
    assert largest_dot_flops(jax.make_jaxpr(f)(*small)) == 2 * 3 * 5 * 7 * 6  # the jit's
    big = (True, jnp.ones((8, 16)), jnp.ones((16, 40)), jnp.ones((3, 5, 6)))
    assert largest_dot_flops(jax.make_jaxpr(f)(*big)) == 2 * 8 * 40 * 16  # the branch's
    assert largest_dot_flops(jax.make_jaxpr(lambda c: c + 1)(1.0)) == 0


@pytest.mark.usefixtures("needs_cpu")
def test_jit_options_leave_small_matmuls_to_xla_on_one_thread():
    """A one-thread program whose matmuls are all small runs them as XLA's dots (YNNPACK
    fusions off, where this jaxlib has them); others keep XLA's choice, and a multi-threaded
    client never reads the jaxpr."""
    from jaxops.cpu import YNN_MAX_DOT_FLOPS, _ynn_option_known, jit_options, jit_options_for
    one = jaxops.cpu_device(1)
    small = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((4, 8)), jnp.ones((8, 4)))
    n = int(YNN_MAX_DOT_FLOPS ** (1 / 3)) + 2
    big = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((n, n)), jnp.ones((n, n)))
    options = jit_options(one, lambda: small)["compiler_options"]
    assert options.get("xla_cpu_experimental_ynn_fusion_type") == \
        ("" if _ynn_option_known(one) else None)
    assert "xla_cpu_experimental_ynn_fusion_type" not in \
        jit_options(one, lambda: big)["compiler_options"]
    assert jit_options(jaxops.cpu_device(3), lambda: 1 / 0) == {}
    # program.jit()'s forwards (forward=True) vectorize XLA's fusions 512 bits wide, others not
    assert jit_options(one, forward=True)["compiler_options"]["xla_cpu_prefer_vector_width"] \
        == 512
    assert "xla_cpu_prefer_vector_width" not in jit_options(one)["compiler_options"]
    assert jit_options(jaxops.cpu_device(3), forward=True) == {}
    # jit_options_for traces the function on the arguments it is given
    matmul = lambda a, b: a @ b  # noqa: E731
    assert jit_options_for(one, matmul, (jnp.ones((4, 8)), jnp.ones((8, 4)))) == \
        jit_options(one, lambda: small)
    assert jit_options_for(one, matmul, (), {"a": jnp.ones((n, n)), "b": jnp.ones((n, n))}) \
        == jit_options(one, lambda: big)
    f = jax.jit(lambda a, b: a @ b, **jit_options(one, lambda: small))
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), one)
    np.testing.assert_allclose(np.asarray(f(x, x.T)), np.asarray(x) @ np.asarray(x).T)


@pytest.mark.usefixtures("needs_cpu")
def test_jit_options_single_thread_eigen_where_one_thread_runs():
    from jaxops.cpu import jit_options
    one = {"compiler_options": {"xla_cpu_multi_thread_eigen": False}}
    assert jit_options(jaxops.cpu_device(1)) == one
    assert jit_options(jaxops.cpu_device(3)) == {}  # a pool of 3 threads works in parallel
    f = jax.jit(lambda a, b: a.T @ b, **jit_options(jaxops.cpu_device(1)))  # jit takes them
    x = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4), jaxops.cpu_device(1))
    np.testing.assert_allclose(np.asarray(f(x, x)), np.asarray(x).T @ np.asarray(x))
