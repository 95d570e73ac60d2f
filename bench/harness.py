"""Shared benchmark machinery.

A run measures the device's copy bandwidth first, then, for every `Case`, in one process:

  jaxops  the op under `jax.jit` (its FFI kernel on this platform),
  XLA     every pure-JAX candidate the case lists, under `jax.jit`; the fastest one whose
          output passes the check is "the XLA peer",
  torch   PyTorch eager, when torch is importable and jax and torch both run on CUDA
          (the inputs are shared with jax through DLPack, not copied).

Each output is checked once against the case's f32 reference before it is timed. The inputs
rotate over K >= 2 sets whose total size exceeds the L2 cache. The headline time of a call:

  jax     K calls, one per input set, one after another inside one jitted executable (as
          ops of a training step: no per-executable cost each; nothing fused across calls),
          in bursts of executions with one sync at the end: time / calls. Stateful cases
          (optimizer steps updating donated buffers) run several steps per call and are timed
          in bursts of calls.
  torch   CUDA-event time of single calls launched back to back.

More figures go to the JSON: "synced_us" (single calls, each followed by a sync: adds the
dispatch and the sync) and "pipelined_us" (a burst of separate calls, one sync at the end).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

MiB = 1 << 20
GiB = 1 << 30
L2_BYTES = 64 * MiB  # H100/H200 have 50 MiB (queried from torch when it can be)

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "f64": jnp.float64}
TOL = {"f32": 1e-4, "f64": 1e-10, "bf16": 2e-2, "f16": 5e-3}


@dataclasses.dataclass
class Case:
    """One benchmark row. Functions are plain (harness jits them); inputs stay on device.

    make_inputs(key) -> tuple of jax arrays: one fresh input set (never zeros).
    jaxops(*inputs) -> output: the op under test. A callable with `stateful = True` is run as
        given instead of jitted: it jits itself and keeps state between calls (an optimizer
        step updating donated buffers in place); its first call must start from the inputs.
    reference(*inputs) -> output in f32 (or f64): the oracle every output is checked against.
    xla: label -> pure-JAX function, the XLA peers (the fastest correct one is reported).
    torch(torch_module, *tensors) -> tensor: PyTorch eager, or None.
    bytes: bytes an ideal kernel moves (reads + writes), for GB/s and % of copy bandwidth.
    baseline: the name of a case whose time per byte this one is compared with.
    steps_per_call: how many steps (of `bytes` each) one call of every implementation runs;
        times are reported per step.
    """

    name: str
    family: str
    op: str
    dtype: str
    shape: tuple[int, ...]
    params: dict
    make_inputs: Callable
    jaxops: Callable
    reference: Callable
    xla: dict[str, Callable]
    torch: Callable | None
    bytes: int
    baseline: str | None = None
    target: float | None = None  # the ceiling for time/byte relative to the baseline
    tol: float | None = None
    steps_per_call: int = 1

    def __post_init__(self):
        if self.tol is None:
            self.tol = TOL[self.dtype]


@dataclasses.dataclass
class Settings:
    quick: bool
    copy_bytes: int
    min_reps: int
    max_reps: int
    budget_s: float  # wall time spent timing one implementation, after warm-up
    warmup: int
    pipe_s: float    # target length of one pipelined burst
    pipe_trials: int
    in_one_bytes: int  # memory the input sets of the one-executable timing may take

    @classmethod
    def make(cls, quick: bool, budget_s: float | None = None):
        if quick:
            return cls(True, 16 * MiB, 5, 50, budget_s or 0.02, 2, 0.005, 2, 0)
        return cls(False, 1 * GiB, 25, 400, budget_s or 0.4, 5, 0.1, 5, 8 * GiB)


# ----------------------------------------------------------------------------------------
# environment


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None


def _git() -> str | None:
    try:
        here = Path(__file__).resolve().parent.parent
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                             capture_output=True, timeout=5)
        if rev.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, text=True, capture_output=True, timeout=5)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        return None


def load_torch():
    """torch when it can run beside jax on CUDA, else None (with the reason)."""
    if jax.default_backend() != "gpu":
        return None, f"jax backend is {jax.default_backend()}"
    try:
        import torch
    except Exception as e:  # not installed, or a broken install
        return None, f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return None, "torch.cuda is not available"
    return torch, None


def environment(torch) -> dict:
    dev = jax.devices()[0]
    try:
        from jaxops._src.ffi import available_platforms
        kernels = list(available_platforms())
    except Exception as e:
        kernels = [f"error: {e}"]
    import jaxlib
    import jaxops
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jax_cuda_plugin": _version("jax-cuda13-plugin") or _version("jax-cuda12-plugin"),
        "numpy": np.__version__,
        "jaxops": getattr(jaxops, "__version__", None),
        "jaxops_git": _git(),
        "jaxops_kernel_platforms": kernels,
        "torch": getattr(torch, "__version__", None) if torch else _version("torch"),
        "env": {k: os.environ.get(k) for k in ("JAXOPS_DISABLE", "XLA_FLAGS", "JAX_PLATFORMS",
                                               "XLA_PYTHON_CLIENT_PREALLOCATE")},
    }
    if torch:
        env["torch_device"] = torch.cuda.get_device_name(0)
        env["torch_cuda"] = torch.version.cuda
    return env


def l2_bytes(torch) -> int:
    if torch:
        try:
            return max(L2_BYTES, int(torch.cuda.get_device_properties(0).L2_cache_size))
        except Exception:
            pass
    return L2_BYTES


# ----------------------------------------------------------------------------------------
# timing


def _jax_sync(out):
    jax.block_until_ready(out)


def burst_seconds(launch: Callable, sync: Callable, burst: int, trials: int) -> float:
    """Median over `trials` of the wall time of launch(0) ... launch(burst - 1) with one sync
    at the end, divided by `burst`."""
    times = []
    for _ in range(trials):
        out = None
        t0 = time.perf_counter()
        for j in range(burst):
            out = launch(j)
        sync(out)
        times.append((time.perf_counter() - t0) / burst)
        del out
    return statistics.median(times)


def time_calls(call: Callable, sync: Callable, argsets: list, s: Settings) -> dict:
    """Median wall time of single synced calls, rotating over argsets; then pipelined bursts."""
    n = len(argsets)
    for i in range(s.warmup):
        sync(call(*argsets[i % n]))
    samples: list[float] = []
    end = time.perf_counter() + s.budget_s
    i = 0
    while len(samples) < s.max_reps and (len(samples) < s.min_reps or time.perf_counter() < end):
        args = argsets[i % n]
        i += 1
        t0 = time.perf_counter()
        sync(call(*args))
        samples.append(time.perf_counter() - t0)
    med = statistics.median(samples)
    burst = max(2 * n, min(200, int(s.pipe_s / max(med, 1e-7))))
    burst = n * math.ceil(burst / n)
    pipe = burst_seconds(lambda j: call(*argsets[j % n]), sync, burst, s.pipe_trials)
    q = np.quantile(samples, [0.1, 0.9])
    # "us": device throughput (a burst, one sync); "synced_us" adds the per-call dispatch and
    # sync, which a jitted training step amortises.
    return {"us": pipe * 1e6, "synced_us": med * 1e6,
            "min_us": min(samples) * 1e6, "p10_us": q[0] * 1e6,
            "p90_us": q[1] * 1e6, "reps": len(samples), "pipelined_us": pipe * 1e6,
            "pipelined_burst": burst}


def time_in_one(fn: Callable, argsets: list, s: Settings) -> dict:
    """Time per call of fn when one executable calls it once per input set (a training step's
    view: no per-executable cost per op); bursts of executions, one sync each."""
    k = len(argsets)

    def chained(sets):
        # The barrier makes each call's inputs wait for the previous output: the calls run
        # one after another and XLA fuses nothing across them.
        outs = []
        for a in sets:
            if outs:
                a, _ = jax.lax.optimization_barrier((tuple(a), outs[-1]))
            outs.append(fn(*a))
        return outs

    many = jax.jit(chained)
    for _ in range(s.warmup):
        _jax_sync(many(argsets))
    t0 = time.perf_counter()
    _jax_sync(many(argsets))
    one = time.perf_counter() - t0
    burst = max(2, min(100, math.ceil(s.pipe_s / max(one, 1e-7))))
    per_execution = burst_seconds(lambda _: many(argsets), _jax_sync, burst, s.pipe_trials)
    return {"in_one_us": per_execution / k * 1e6, "in_one_calls": k, "in_one_burst": burst}


def torch_event_us(torch, call: Callable, argsets: list, reps: int) -> float:
    """Median CUDA-event time of single calls, launched back to back, one sync at the end."""
    n = len(argsets)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]
    for i, (a, b) in enumerate(pairs):
        args = argsets[i % n]
        a.record()
        call(*args)
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) * 1e3


# ----------------------------------------------------------------------------------------
# copy bandwidth


def copy_bandwidth(s: Settings, torch, log=print) -> dict:
    """Device-to-device copy bandwidth, bytes read + written per second; the max measured."""
    n = s.copy_bytes // 4
    found: dict[str, float] = {}
    x = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32))(jax.random.key(0))
    one = jnp.float32(1.0)  # a runtime operand: XLA cannot fold `x * s` into `x`
    scale = jax.jit(lambda x, s: x * s)
    y = scale(x, one)
    jax.block_until_ready(y)
    try:
        same = y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    except Exception:
        same = False
    if same:
        log("copy bandwidth: jax `x * s` returned its input buffer; not counted")
    else:
        t = time_calls(scale, _jax_sync, [(x, one)], s)
        found["jax x*s (per call)"] = 2 * s.copy_bytes / (t["us"] * 1e-6)
        found["jax x*s (pipelined)"] = 2 * s.copy_bytes / (t["pipelined_us"] * 1e-6)
    del x, y
    if torch:
        src = torch.empty(n, device="cuda", dtype=torch.float32).normal_()
        dst = torch.empty_like(src)
        ev = torch_event_us(torch, lambda: dst.copy_(src), [()], 5)  # warm-up
        ev = torch_event_us(torch, lambda: dst.copy_(src), [()], 50)
        found["torch copy_ (events)"] = 2 * s.copy_bytes / (ev * 1e-6)
        t = time_calls(lambda: dst.copy_(src), lambda _: torch.cuda.synchronize(), [()], s)
        found["torch copy_ (per call)"] = 2 * s.copy_bytes / (t["us"] * 1e-6)
        del src, dst
        torch.cuda.empty_cache()
    gc.collect()
    best = max(found, key=found.get)
    for k, v in found.items():
        log(f"  {k:26s} {v / 1e9:9.1f} GB/s")
    return {"bytes_per_s": found[best], "method": best, "measured": found,
            "buffer_bytes": s.copy_bytes}


# ----------------------------------------------------------------------------------------
# one case


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first[:300]


def _rel_err_fn():
    def leaf_err(out, ref):
        ref = ref.astype(jnp.float32)
        d = jnp.max(jnp.abs(out.astype(jnp.float32) - ref))
        return d / jnp.maximum(jnp.max(jnp.abs(ref)), jnp.finfo(jnp.float32).tiny)

    @jax.jit
    def err(out, ref):  # the worst over the outputs, for ops with several
        outs, refs = jax.tree.leaves(out), jax.tree.leaves(ref)
        if len(outs) != len(refs):
            return jnp.float32(jnp.inf)
        return jnp.max(jnp.stack([leaf_err(o, r) for o, r in zip(outs, refs)]))
    return err


def _torch_to_jax(t):
    try:
        return jnp.from_dlpack(t)
    except Exception:  # no DLPack exchange this way (e.g. a strided view): go through the host
        return jnp.asarray(t.float().cpu().numpy())


def n_input_sets(set_bytes: int, l2: int, s: Settings) -> int:
    """>= 2 sets whose total is at least twice the L2 cache, and up to 8 (K calls share one
    executable's cost in `time_in_one`) while they fit in s.in_one_bytes. Quick runs: 2."""
    if s.quick:
        return 2
    fit = s.in_one_bytes // max(set_bytes, 1)
    return int(min(16, max(2, math.ceil(2 * l2 / max(set_bytes, 1)), min(8, fit))))


def run_case(case: Case, s: Settings, torch, copy_bw: float, l2: int, log=print) -> dict:
    res: dict[str, Any] = {
        "name": case.name, "family": case.family, "op": case.op, "dtype": case.dtype,
        "shape": list(case.shape), "params": case.params, "bytes": case.bytes,
        "baseline": case.baseline, "target": case.target,
        "steps_per_call": case.steps_per_call, "impls": {},
    }
    make = jax.jit(case.make_inputs)
    first = make(jax.random.key(1))
    set_bytes = sum(a.size * a.dtype.itemsize for a in first)
    n = n_input_sets(set_bytes, l2, s)
    argsets = [first] + [make(jax.random.key(1 + i)) for i in range(1, n)]
    jax.block_until_ready(argsets)
    res["input_sets"] = n
    res["input_set_bytes"] = set_bytes
    ref = jax.jit(case.reference)(*argsets[0])
    err_fn = _rel_err_fn()

    def record(label, timing, err, tol):
        timing = {k: v / case.steps_per_call if k == "us" or k.endswith("_us") else v
                  for k, v in timing.items()}
        rec = {"status": "ok", "max_rel_err": err, "tol": tol,
               "correct": bool(err <= tol)}  # NaN fails
        rec.update(timing)
        rec["gbps"] = case.bytes / (timing["us"] * 1e-6) / 1e9
        rec["pct_copy"] = 100 * case.bytes / (timing["us"] * 1e-6) / copy_bw
        res["impls"][label] = rec
        return rec

    def run_jax(label, fn):
        try:
            stateful = getattr(fn, "stateful", False)
            f = fn if stateful else jax.jit(fn)
            out = f(*argsets[0])
            err = float(err_fn(out, ref))
            del out
            timing = time_calls(f, _jax_sync, argsets, s)
            if not stateful:
                timing.update(time_in_one(fn, argsets, s))
                timing["us"] = timing["in_one_us"]
            rec = record(label, timing, err, case.tol)
            log(f"    {label:12s} {rec['us']:10.1f} us  {rec['gbps']:7.1f} GB/s  "
                f"{rec['pct_copy']:5.1f}%  err {err:.1e}{'' if rec['correct'] else '  FAILS CHECK'}")
        except Exception as e:
            res["impls"][label] = {"status": "error", "error": _short(e),
                                   "traceback": traceback.format_exc()[-4000:]}
            log(f"    {label:12s} ERROR {_short(e)}")

    run_jax("jaxops", case.jaxops)
    for label, fn in case.xla.items():
        run_jax(f"xla:{label}", fn)

    if torch and case.torch is not None:
        try:
            targs = [tuple(torch.from_dlpack(a) for a in args) for args in argsets]
            call = lambda *a: case.torch(torch, *a)
            out = call(*targs[0])
            torch.cuda.synchronize()
            back = jax.tree.map(_torch_to_jax, out)  # a tuple for ops with several outputs
            err = float(err_fn(back, ref))
            del back
            del out
            timing = time_calls(call, lambda _: torch.cuda.synchronize(), targs, s)
            timing["events_us"] = torch_event_us(torch, call, targs, max(10, min(100, timing["reps"])))
            timing["us"] = timing["events_us"]
            rec = record("torch", timing, err, case.tol)
            log(f"    {'torch':12s} {rec['us']:10.1f} us  {rec['gbps']:7.1f} GB/s  "
                f"{rec['pct_copy']:5.1f}%  err {err:.1e}  (events {timing['events_us']:.1f} us)"
                f"{'' if rec['correct'] else '  FAILS CHECK'}")
            del targs
        except Exception as e:
            res["impls"]["torch"] = {"status": "error", "error": _short(e),
                                     "traceback": traceback.format_exc()[-4000:]}
            log(f"    {'torch':12s} ERROR {_short(e)}")

    # the XLA peer: the fastest candidate that passes the check
    ok = {k: v for k, v in res["impls"].items()
          if k.startswith("xla:") and v["status"] == "ok" and v["correct"]}
    res["xla"] = min(ok, key=lambda k: ok[k]["us"]) if ok else None
    peers = {}
    if res["xla"]:
        peers[res["xla"]] = ok[res["xla"]]["us"]
    t = res["impls"].get("torch")
    if t and t["status"] == "ok" and t["correct"]:
        peers["torch"] = t["us"]
    res["best_peer"] = min(peers, key=peers.get) if peers else None
    j = res["impls"]["jaxops"]
    if j["status"] == "ok" and j["correct"] and res["best_peer"]:
        res["speedup"] = peers[res["best_peer"]] / j["us"]
    else:
        res["speedup"] = None
    argsets = first = ref = None  # drops the device buffers (not `del`: closures above use them)
    if torch:
        torch.cuda.empty_cache()
    gc.collect()
    return res


def relative_cost(results: list[dict]) -> None:
    """Adds `rel_time_per_byte` (per implementation) to each case with a baseline."""
    by_name = {r["name"]: r for r in results}
    for r in results:
        base = by_name.get(r.get("baseline"))
        if base is None:
            continue
        rel = {}
        for label in ("jaxops", "xla", "torch"):
            a = _timed(r, label)
            b = _timed(base, label)
            if a and b:
                rel[label] = (a["us"] / r["bytes"]) / (b["us"] / base["bytes"])
        r["rel_time_per_byte"] = rel


def _timed(r: dict, label: str) -> dict | None:
    key = r.get("xla") if label == "xla" else label
    rec = r["impls"].get(key) if key else None
    return rec if rec and rec.get("status") == "ok" else None


# ----------------------------------------------------------------------------------------
# report


def _cell(rec: dict | None) -> str:
    if rec is None:
        return "–"
    if rec.get("status") != "ok":
        return "ERR"
    flag = "" if rec["correct"] else f" ✗err {rec['max_rel_err']:.0e}"
    return f"{rec['us']:.1f} / {rec['gbps']:.0f} / {rec['pct_copy']:.0f}%{flag}"


def table(report: dict) -> str:
    env, copy, results = report["environment"], report["copy_bandwidth"], report["results"]
    torch_txt = f"torch {env['torch']}" if env.get("torch") else "torch –"
    lines = [
        f"### jaxops bench — {env['device']} ({env['backend']}), {env['date'][:10]}"
        f"{' — QUICK' if report['quick'] else ''}",
        "",
        f"jax {env['jax']}, jaxlib {env['jaxlib']}, {torch_txt}, jaxops {env['jaxops']}"
        f" ({env['jaxops_git'] or 'no git'}); copy bandwidth {copy['bytes_per_s'] / 1e9:.0f} GB/s"
        f" ({copy['method']}, read+write). Cells: µs / GB/s / % of copy; jax: one call per input"
        f" set inside one executable, median over bursts of executions with one sync (optimizer"
        f" steps: bursts of calls); torch: median CUDA-event time; inputs rotated over ≥2 sets >"
        f" L2; bytes: what the op must read and write (see bench/<family>.py).",
    ]
    if env["env"].get("JAXOPS_DISABLE"):
        lines.append(f"**WARNING: JAXOPS_DISABLE={env['env']['JAXOPS_DISABLE']}: the jaxops "
                     "column may be the pure-JAX reference.**")
    if report.get("torch_skipped"):
        lines.append(f"(torch skipped: {report['torch_skipped']})")
    lines += ["", "| case | MB | jaxops | XLA | torch | jaxops vs best peer |",
              "|---|---:|---|---|---|---|"]
    notes: dict[str, list[str]] = {}  # one line per distinct message
    for r in results:
        cands = {k: v for k, v in r["impls"].items() if k.startswith("xla:")}
        timed = {k: v for k, v in cands.items() if v["status"] == "ok"}
        shown = r["xla"] or (min(timed, key=lambda k: timed[k]["us"]) if timed else None)
        if shown:  # the peer, or else the fastest candidate (its cell flags the failed check)
            xla_txt = _cell(cands[shown]) + (f" ({shown[4:]})" if len(cands) > 1 else "")
        else:
            xla_txt = "ERR" if cands else "–"
        sp = (f"{r['speedup']:.2f}x vs {'XLA' if r['best_peer'].startswith('xla') else r['best_peer']}"
              if r.get("speedup") else "–")
        mb = r["bytes"] / 1e6
        mb_txt = f"{mb:.0f}" if mb >= 10 else f"{mb:.2g}"
        lines.append(f"| {r['name']} | {mb_txt} | {_cell(r['impls'].get('jaxops'))}"
                     f" | {xla_txt} | {_cell(r['impls'].get('torch'))} | {sp} |")
        for label, rec in r["impls"].items():
            if rec.get("status") == "error":
                notes.setdefault(f"{label}: {rec['error']}", []).append(r["name"])
            elif rec.get("status") == "ok" and not rec["correct"]:
                notes.setdefault(f"{label}: max rel err {rec['max_rel_err']:.2e} > tol"
                                 f" {rec['tol']:.0e}", []).append(r["name"])
    lines += ["", "One call a jitted executable (µs): a burst of calls with one sync / a single call"
              " followed by a sync (adds the dispatch and the sync)",
              "", "| case | jaxops | XLA | torch |", "|---|---:|---:|---:|"]
    for r in results:
        def pipe(label):
            rec = _timed(r, label)
            if rec is None:
                return "–"
            return f"{rec['pipelined_us']:.1f} / {rec['synced_us']:.1f}"
        lines.append(f"| {r['name']} | {pipe('jaxops')} | {pipe('xla')} | {pipe('torch')} |")
    rel = [r for r in results if r.get("baseline")]
    if rel:
        lines += ["", "Non-last-axis cost: time per byte relative to the baseline case"
                  " (same op/dtype, last axis)", "",
                  "| case | baseline | jaxops | XLA | torch | target |", "|---|---|---:|---:|---:|---|"]
        for r in rel:
            rt = r.get("rel_time_per_byte", {})
            f = lambda k: f"{rt[k]:.2f}x" if k in rt else "–"
            tgt = r.get("target")
            verdict = ""
            if tgt and "jaxops" in rt:
                verdict = f"≤{tgt}x {'ok' if rt['jaxops'] <= tgt else 'MISSED'}"
            lines.append(f"| {r['name']} | {r['baseline']} | {f('jaxops')} | {f('xla')} |"
                         f" {f('torch')} | {verdict} |")
    if notes:
        lines += ["", "Notes:"]
        for msg, names in notes.items():
            where = names[0] if len(names) == 1 else f"{len(names)} cases ({names[0]}, ...)"
            lines.append(f"- {where}: {msg}")
    return "\n".join(lines)


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return _clean(x.item())
    return x


def write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(report), indent=1, allow_nan=False))
    tmp.replace(path)


# ----------------------------------------------------------------------------------------
# the run


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(cases: list[Case], *, quick: bool, out: Path, budget_s: float | None = None,
        log=print) -> dict:
    signal.signal(signal.SIGTERM, _on_sigterm)  # a timeout still gets the table printed
    s = Settings.make(quick, budget_s)
    torch, why_not = load_torch()
    env = environment(torch)
    log(f"device: {env['device']} ({env['backend']}), jax {env['jax']}, jaxlib {env['jaxlib']},"
        f" torch {env['torch']}, jaxops kernels on {env['jaxops_kernel_platforms']}")
    if why_not:
        log(f"torch peer skipped: {why_not}")
    if env["env"].get("JAXOPS_DISABLE"):
        log(f"WARNING: JAXOPS_DISABLE={env['env']['JAXOPS_DISABLE']}")
    if not quick and env["backend"] == "cpu":
        log("WARNING: full-size cases on CPU will be slow; use --quick")
    report: dict[str, Any] = {"quick": quick, "environment": env, "settings": dataclasses.asdict(s),
                              "torch_skipped": why_not, "results": [], "complete": False}
    t_start = time.perf_counter()
    try:
        log(f"copy bandwidth ({s.copy_bytes / MiB:.0f} MiB buffer):")
        report["copy_bandwidth"] = copy_bandwidth(s, torch, log)
        copy_bw = report["copy_bandwidth"]["bytes_per_s"]
        l2 = l2_bytes(torch)
        for i, case in enumerate(cases, 1):
            log(f"[{i}/{len(cases)}] {case.name}  ({case.bytes / 1e6:.1f} MB moved)")
            report["results"].append(run_case(case, s, torch, copy_bw, l2, log))
            relative_cost(report["results"])
            write(report, out)
        report["complete"] = True
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); reporting the {len(report['results'])} finished cases")
    finally:
        report["wall_s"] = time.perf_counter() - t_start
        if "copy_bandwidth" in report:
            relative_cost(report["results"])
            report["table"] = table(report)
            write(report, out)
            out.with_suffix(".md").write_text(report["table"] + "\n")
            log("")
            log(report["table"])
            log("")
            log(f"wrote {out} and {out.with_suffix('.md')} ({report['wall_s']:.0f} s)")
    return report
