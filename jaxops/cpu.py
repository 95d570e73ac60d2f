"""How XLA:CPU runs jaxops' programs: one thread for small models.

XLA:CPU runs a jitted call on its own execute thread (async dispatch) and spreads a program's
independent operations and large kernels over an intra-op pool of one thread a core. For the
small models ORT's training API is used with on CPUs (steps of 0.1-0.5 ms), those hand-offs
cost more than they bring: every call wakes threads on other cores, which on a VM whose idle
vCPUs halt costs tens of microseconds each. ORT's `intra_op_num_threads` has two XLA
counterparts: `cpu_device(threads)`, a device of an XLA:CPU client of its own (per Module, at
any time: the ORT-API mirror's Module uses it for session_options and moves a small model to
`cpu_device(1)` by itself), and `configure_cpu(threads)`, which sets jax's default client for
the whole process and must run before jax starts its backends (the client reads it when it is
created). Importing it picks XLA:CPU's memory-minimizing scheduler, whose programs hand
fewer operations to pool threads (prefer_memory_scheduler), and caps LLVM's full loop
unrolling where jax's XLA:CPU runs narrow loops scalar otherwise (cap_llvm_unroll): XLA's
flags, per process, read when jax's backends start.

What it gains on the real-model corpus: docs/training.md, "Small models on a CPU" (the
measured counts, kept there only).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os

import jax

from jaxops._src.compat import backends_started, jax_release_in
from jaxops._src.disable import disabled

__all__ = ["configure_cpu", "cpu_device"]

_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
# jax releases whose XLA knows the flag (an XLA that does not aborts on an unknown XLA_FLAGS
# entry): the ones jaxops is tested with
_SCHEDULER_JAX = ((0, 8), (0, 13))


def prefer_memory_scheduler() -> bool:
    """XLA:CPU's memory-minimizing scheduler in place of its concurrency-optimized default for
    this process's programs (appends `--xla_cpu_enable_concurrency_optimized_scheduler=false`
    to XLA_FLAGS), run when jaxops is imported and by configure_cpu; jax reads the flags when
    its backends start, and only there: XLA:CPU takes no scheduler from a jit's
    compiler_options. The default gives a program's independent operations buffers of their
    own so that the thunk executor can run them at once, handing ready ones to the intra-op
    pool; on small programs those hand-offs (a pool thread woken after any pause; on one core,
    a context switch) cost more than they bring. A small model's Module that moved to a
    one-thread client (all cores, jax's defaults) still handed each eval call to that
    client's pool thread and waited: RegNet_ts's eval 98-162 -> 76 us a call in a loop, 119-133
    -> 100-105 after an idle wait (2 vCPUs, 2026-11-29; docs/performance.md, twentieth
    session). Corpus at one thread (2026-11-28, eleventh session): forwards no slower than
    ORT's 22-25 of 32 with it, 18 without. The cost: `jax.checkpoint`'s and
    gist_checkpoint's compiled temp memory on the CPU shows less of their saving (docs/gist.md).
    Not where XLA_FLAGS names the flag already (`=true` keeps XLA's scheduler), after the
    backends started, on jax releases outside _SCHEDULER_JAX, or with
    JAXOPS_DISABLE=memory_scheduler. Returns whether it set the flag."""
    return _add_xla_flag(_SCHEDULER_FLAG, f"{_SCHEDULER_FLAG}=false", _SCHEDULER_JAX,
                         "memory_scheduler")


def _add_xla_flag(name: str, entry: str, releases, disable: str) -> bool:
    """Appends `entry` to XLA_FLAGS unless XLA_FLAGS names `name` already (the user's
    choice), this jax is not one of `releases`, JAXOPS_DISABLE names `disable`, or jax's
    backends have started (they read the flags then). Returns whether it did."""
    flags = os.environ.get("XLA_FLAGS", "")
    if (name in flags or not jax_release_in(releases) or disabled(disable)
            or backends_started()):
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {entry}".strip()
    return True


# LLVM's full unrolling capped at 8 iterations (XLA_FLAGS, read when the backends start), for
# the jax releases whose XLA:CPU measured faster with it: cap_llvm_unroll
_UNROLL_OPTION = "--xla_backend_extra_options"
_UNROLL_FLAG = f"{_UNROLL_OPTION}=-unroll-full-max-count=8"
_UNROLL_JAX = ((0, 12), (0, 13))


def cap_llvm_unroll() -> bool:
    """Caps LLVM's full loop unrolling at 8 iterations for this process's XLA programs
    (appends `--xla_backend_extra_options=-unroll-full-max-count=8` to XLA_FLAGS), run when
    jaxops is imported. jax 0.12's XLA:CPU fully unrolls the inner loop of an elementwise
    fusion or a reduction whose minor dimension has 16-48 elements and then runs it scalar
    (one `vfmadd132ss` a value): capped, LLVM's loop vectorizer takes it. One core,
    2026-11-29 (docs/performance.md, nineteenth session), us a fusion: `max(x * 1.5 + 0.5, 0)`
    on [512, 16] 3.24 -> 0.39, softmax over the last axis of [1024, 128] 186.5 -> 77.0 and of
    [512, 16] 16.6 -> 6.2, a layer norm 75.6 -> 30.2 and 5.6 -> 4.4; none of 80 fusions tried
    slower beyond the runs' spread; jax 0.8's XLA vectorizes these already (0.13-0.15 us).
    On the GPU (H200, the 46M-parameter train step, two runs each way) 14.51-14.55 ms tf32
    and 7.39 ms bf16 without it, 14.55-14.59 and 7.40-7.49 with it.
    Not where XLA_FLAGS names xla_backend_extra_options already (the user's choice), where
    jax's backends have started (the flags are read then), for other jax releases, or with
    JAXOPS_DISABLE=unroll_cap. Returns whether it set the flag."""
    return _add_xla_flag(_UNROLL_OPTION, _UNROLL_FLAG, _UNROLL_JAX, "unroll_cap")


cap_llvm_unroll()
prefer_memory_scheduler()

_CLIENTS: dict[int, object] = {}  # cpu_device's clients, one a thread count


def xla_threads(device: jax.Device | None = None) -> int:
    """XLA:CPU's intra-op threads for `device`: cpu_device's count for its devices; else (jax's
    default client) `PJRT_NPROC` where set (configure_cpu sets it), else one a core this
    process may run on."""
    for threads, client in _CLIENTS.items():
        if device is not None and device.client is client:
            return threads
    try:
        return max(1, int(os.environ["PJRT_NPROC"]))
    except (KeyError, ValueError):
        pass
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_KERNEL_THREADS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "jaxops_kernel_threads", default=None)


def kernel_threads() -> int:
    """The threads jaxops' own CPU kernels may use in the program being traced:
    `kernel_threads_as`'s count, else 1. The inference convolution runs on XLA's calling
    thread and shares a large one with up to this many - 1 helper threads: the small
    forwards, Modules and eval steps that move to `cpu_device(1)` by themselves (XLA then runs
    them on one thread) are traced with the default client's count (xla_threads():
    configure_cpu's, else the cores this process may run on), as ORT's session at its defaults
    runs a convolution on every core. Elsewhere XLA's own pool has the cores (sharing there
    made ResNet's forward, corpus, 2 vCPUs, 2.20 -> 2.51 ms)."""
    threads = _KERNEL_THREADS.get()
    return 1 if threads is None else threads


@contextlib.contextmanager
def kernel_threads_as(threads: int):
    """kernel_threads() is `threads` inside (for a trace)."""
    token = _KERNEL_THREADS.set(_check_threads("kernel_threads_as", threads))
    try:
        yield
    finally:
        _KERNEL_THREADS.reset(token)


def traced_with_kernel_threads(fn, threads: int):
    """fn, traced (called) under kernel_threads_as(threads): what jax.jit takes."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with kernel_threads_as(threads):
            return fn(*args, **kwargs)
    return traced


def concurrent_scheduler() -> bool:
    """Whether XLA:CPU schedules this process's programs for concurrency (XLA's default: where
    the user's XLA_FLAGS or JAXOPS_DISABLE=memory_scheduler keep it), not to minimize memory
    (prefer_memory_scheduler's choice at import)."""
    return f"{_SCHEDULER_FLAG}=false" not in os.environ.get("XLA_FLAGS", "")


# The largest matmul (FLOPs, jaxpr's dot_general) of a one-thread program that runs its matmuls
# as XLA's own dots rather than in YNNPACK fusions: at these sizes a fusion's call costs more
# than its kernel gains (docs/performance.md, eighteenth session).
YNN_MAX_DOT_FLOPS = 1 << 18
_YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"


@functools.cache
def _ynn_option_known(device: jax.Device) -> bool:
    """Whether this jaxlib's XLA:CPU has YNNPACK fusions to turn off (jax 0.8's does not, and
    rejects the option): a trivial program compiled once for `device`, a CPU."""
    try:
        one = jax.sharding.SingleDeviceSharding(device)
        jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), "float32", sharding=one)) \
            .compile(compiler_options={_YNN_OPTION: ""})
    except Exception:  # noqa: BLE001 (any refusal means the option is not there)
        return False
    return True


def largest_dot_flops(jaxpr) -> int:
    """The most FLOPs of one dot_general in `jaxpr` (a Jaxpr or ClosedJaxpr) and the jaxprs in
    its equations' parameters (jit, cond branches, custom derivatives); 0 where none."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    most = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = math.prod(lhs[d] for d in contract)
            most = max(most, 2 * k * math.prod(eqn.outvars[0].aval.shape))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    most = max(most, largest_dot_flops(sub))
    return most


# LLVM's preferred vector width for XLA's own code (its fusions) in a one-thread forward
# (jit_options' forward=True): XLA's default, 256 bits, leaves half of an AVX-512 register unused
# on the 16-64 channels of the corpus's convolution models
_VECTOR_OPTION = "xla_cpu_prefer_vector_width"


def jit_options(device: jax.Device | None = None, jaxpr=None, *, forward: bool = False) -> dict:
    """jax.jit's keyword arguments for a program placed on `device` (None: jax's default
    device): on a CPU whose XLA client runs one intra-op thread, XLA's single-threaded Eigen
    kernels. With the multi-threaded ones XLA:CPU hands each Eigen matmul (the transposed
    products of weight gradients, which its YNNPACK fusions do not take) to that one pool
    thread and runs the rest of the program there: a context switch a train step (llama_ts,
    corpus, one core), for no parallelism, as the calling thread only waits. Bound to one
    core, llama_ts's ORT-API step took 0.86-0.90x the time with them single-threaded
    (2026-11-29, A/B in one process; docs/performance.md, seventeenth session).
    `jaxpr` (where given: a function of no arguments that returns the program's jaxpr, called
    only for such a device): if its matmuls are all at most YNN_MAX_DOT_FLOPS, XLA's own dots
    instead of YNNPACK fusions (eighteenth session).
    `forward`: the program is program.jit()'s forward (weights as constants), whose fusions
    XLA then vectorizes 512 bits wide where the CPU has AVX-512 (_VECTOR_OPTION): every
    forward.onnx of the corpus ran 3-8% faster so (one core, in-process A/B, 2026-12-04;
    docs/performance.md, thirtieth session), where the Module's steps measured 0.93-1.08x
    the time, BERT's eval and ResNet's train step slower (not given to them)."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "cpu" or xla_threads(device) != 1:
        return {}
    options = {"xla_cpu_multi_thread_eigen": False}
    if forward:
        options[_VECTOR_OPTION] = 512
    if (jaxpr is not None and _ynn_option_known(device)
            and largest_dot_flops(jaxpr()) <= YNN_MAX_DOT_FLOPS):
        options[_YNN_OPTION] = ""
    return {"compiler_options": options}


def jit_options_for(device: jax.Device | None, fn, args, kwargs=None, *,
                    forward: bool = False) -> dict:
    """jit_options for `fn` called on `args` (and `kwargs`): its jaxpr there, traced only
    where jit_options reads it (a one-thread CPU)."""
    return jit_options(device, lambda: jax.make_jaxpr(fn)(*args, **(kwargs or {})),
                       forward=forward)


def _check_threads(fn: str, threads) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{fn}: threads must be an int >= 1, got {threads!r}")
    return threads


def cpu_device(threads: int) -> jax.Device:
    """A CPU device of an XLA:CPU client of its own with `threads` intra-op threads (one: each
    call runs on the calling thread, no async dispatch), made once a count: ORT's per-session
    `intra_op_num_threads` for one Module (pass it as `device`, or the session_options), at
    any time, jax's default CPU client left as it is. Arrays on it are on another client than
    jax's default device's: move them (`jax.device_put`) to combine them with arrays placed
    there. XLA's flags stay the process's (configure_cpu's scheduler choice needs XLA_FLAGS
    before jax starts)."""
    _check_threads("cpu_device", threads)
    if threads not in _CLIENTS:
        from jax._src.lib import xla_client

        saved = os.environ.get("PJRT_NPROC")
        os.environ["PJRT_NPROC"] = str(threads)  # read as the client is made
        try:
            _CLIENTS[threads] = xla_client.make_cpu_client(asynchronous=threads > 1)
        finally:
            if saved is None:
                del os.environ["PJRT_NPROC"]
            else:
                os.environ["PJRT_NPROC"] = saved
    return _CLIENTS[threads].devices()[0]


def configure_cpu(threads: int | None = None) -> None:
    """Sets XLA:CPU's intra-op threads for this process (`PJRT_NPROC`) and (as importing
    jaxops does: prefer_memory_scheduler) its memory-minimizing scheduler; `threads=1` also
    runs each jitted CPU call on the calling thread (`jax_cpu_enable_async_dispatch` off), as
    an ORT session with `intra_op_num_threads=1` does. `None` leaves XLA's defaults (a thread
    a core, async dispatch) in place.

    Call it before anything starts jax's backends (`jax.devices()`, the first jitted call,
    loading a model's weights onto a device): a RuntimeError says so otherwise, since the
    settings would silently not apply. Other processes and the GPU are unaffected; jax's other
    CPU work in this process (your own jitted functions) runs with the same settings.
    """
    if threads is None:
        return
    _check_threads("configure_cpu", threads)
    if backends_started():
        raise RuntimeError(
            "configure_cpu: jax's backends have already started (a jax computation, "
            "jax.devices() or a model load ran before it), so XLA:CPU's threads are fixed for "
            "this process: call jaxops.configure_cpu first, right after the imports")
    os.environ["PJRT_NPROC"] = str(threads)
    prefer_memory_scheduler()
    if threads == 1:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
