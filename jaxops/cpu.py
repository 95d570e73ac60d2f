"""How XLA:CPU runs jaxops' programs: its scheduler, and `configure_cpu(threads=1)` for small
models.

Importing jaxops makes XLA:CPU schedule programs to minimize memory (XLA_FLAGS
--xla_cpu_enable_concurrency_optimized_scheduler=false) unless XLA_FLAGS already names that
flag or jax's backends have started (the flag is read when they start). XLA's default keeps
independent operations in buffers of their own so that its thunk executor can run them at
once, handing ready ones to the intra-op pool; on the small programs ORT's training API is
used with, those hand-offs (a pool thread woken; on one core, a context switch) cost more than
they bring, and reused buffers stay in cache. Corpus (2 vCPUs, 2026-11-28, `python -m
bench.cpu_corpus`, one run without the flag, three with it): forwards no slower than ORT's at
one thread 22-25 of 32 (18 without), at both libraries' defaults 10-17 of 32 (5), training
steps at the defaults 7-11 of 26 (7); RegNet's eval after an idle wait 68 -> 58 us at one
thread, GPT-2's 125 -> 86 us on both cores (docs/performance.md, eleventh session).
`XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=true` keeps XLA's default.

XLA:CPU runs a jitted call on its own execute thread (async dispatch) and spreads a program's
independent operations and large kernels over an intra-op pool of one thread a core. For the
small models ORT's training API is used with on CPUs (steps of 0.1-0.5 ms), those hand-offs
cost more than they bring: every call wakes threads on other cores, which on a VM whose idle
vCPUs halt costs tens of microseconds each. ORT's `intra_op_num_threads=1` has an XLA
counterpart, with two differences: it is process-wide (XLA's CPU client is one per process) and
it must be set before jax starts its backends (the client reads it when it is created).

Measured on the real-model corpus (2 vCPUs, ORT 1.19.2 at its defaults on both, 2026-11-27,
`python -m bench.cpu_corpus`, its `all1` rows, three runs): jaxops' training step no slower
than ORT's for 23-25 of 26 exports with threads=1 against 13-17 with XLA's defaults, its
forward for 21-22 of 32 against 5-8 (docs/performance.md).
"""
from __future__ import annotations

import os

import jax

from jaxops._src.compat import backends_started

__all__ = ["configure_cpu"]

_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
# jax releases whose XLA knows the flag (an XLA that does not aborts on an unknown XLA_FLAGS
# entry): the ones jaxops is tested with
_SCHEDULER_JAX = ((0, 8), (0, 13))


def _prefer_memory_scheduler() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    version = tuple(int(v) for v in jax.__version__.split(".")[:2])
    if (_SCHEDULER_FLAG in flags or backends_started()
            or not _SCHEDULER_JAX[0] <= version < _SCHEDULER_JAX[1]):
        return
    os.environ["XLA_FLAGS"] = f"{flags} {_SCHEDULER_FLAG}=false".strip()


_prefer_memory_scheduler()


def configure_cpu(threads: int | None = None) -> None:
    """Sets XLA:CPU's intra-op threads for this process (`PJRT_NPROC`); `threads=1` also runs
    each jitted CPU call on the calling thread (`jax_cpu_enable_async_dispatch` off), as an ORT
    session with `intra_op_num_threads=1` does. `None` leaves XLA's defaults (a thread a core,
    async dispatch) in place.

    Call it before anything starts jax's backends (`jax.devices()`, the first jitted call,
    loading a model's weights onto a device): a RuntimeError says so otherwise, since the
    settings would silently not apply. Other processes and the GPU are unaffected; jax's other
    CPU work in this process (your own jitted functions) runs with the same settings.
    """
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"configure_cpu: threads must be an int >= 1, got {threads!r}")
    if backends_started():
        raise RuntimeError(
            "configure_cpu: jax's backends have already started (a jax computation, "
            "jax.devices() or a model load ran before it), so XLA:CPU's threads are fixed for "
            "this process: call jaxops.configure_cpu first, right after the imports")
    os.environ["PJRT_NPROC"] = str(threads)
    if threads == 1:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
