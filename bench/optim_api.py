"""python -m bench.optim_api [--quick]: AdamW over GPT-2 small's 148 tensors (124M f32) the ways
users call it, each in two modes:

  loop      STEPS steps inside one jitted call (an optimization barrier between steps, as a
            training step's forward and backward would be), buffers donated, in bursts of
            calls with one sync at the end;
  per call  one jitted call per step, donated, in bursts of calls with one sync at the end:
            the host's dispatch of the call's buffers is paid every step.

Paths: optax.adamw (update + apply_updates); jaxops.optim.adamw's update + apply_updates and
its fused `.step` (these three timed interleaved, burst by burst, in each mode; each also
prints its executable's fusions and copies and the host's time to enqueue a call); the ORT-API
mirror's `Optimizer.step()` (jaxops.onnx.training, packed flat buffers), its
OptimizerModel.update_packed in a loop, and the per-name OptimizerModel.update (what
`Optimizer.step()` ran before packing); torch.optim.AdamW(fused=True) where torch has CUDA.
Ideal traffic: 7 x 4 bytes a parameter a step (read w, g, m1, m2; write w, m1, m2).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

STEPS = 4


def _timed(run_burst, sync, steps_per_burst, trials=5, warmup=2):
    for _ in range(warmup):
        sync(run_burst())
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        sync(run_burst())
        times.append((time.perf_counter() - t) / steps_per_burst)
    return statistics.median(times)


def _fresh(arrays):
    return [jnp.copy(x) for x in arrays]


def _interleaved(bursts, sync, trials=5, warmup=2):
    """Median seconds a step of each {name: (run_burst, steps_per_burst)}, the bursts taken in
    turn (A, B, C, A, B, C, ...) so that every path sees the same drift of clocks and host load
    (timed one path after the other, jaxops' update measured 6% and 14% slower than optax's
    per call in two H100 runs, level in the loop)."""
    for run, _ in bursts.values():
        for _ in range(warmup):
            sync(run())
    times = {name: [] for name in bursts}
    for _ in range(trials):
        for name, (run, steps) in bursts.items():
            t = time.perf_counter()
            sync(run())
            times[name].append((time.perf_counter() - t) / steps)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _entry_ops(jitted, *args):
    """Fusions and copies in the compiled executable's entry computation (on this device): a
    copy there is a pass over a buffer that a donated input should have made unnecessary."""
    text = jitted.lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    return {"fusions": entry.count(" fusion("), "copies": entry.count(" copy(")}


def _optax_like(paths, w, g, m1, m2, calls):
    """{name: {mode: seconds a step}} of optax-style transformations, paths = {name: (tx,
    "update" | "step")}, the paths of a mode timed interleaved; also prints each executable's
    fusions and copies."""
    import optax

    from bench.optim import _with_moments

    def one(tx, path):
        def f(params, state, grads):
            if path == "step":
                return tx.step(grads, state, params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state
        return f

    def loop(tx, path):
        def f(params, state, grads):
            for _ in range(STEPS):
                params, state = jax.lax.optimization_barrier(one(tx, path)(params, state, grads))
            return params, state
        return f

    out = {name: {} for name in paths}
    for mode, make, per in (("loop", loop, STEPS), ("per call", one, 1)):
        n_calls = calls // per  # a loop's calls in a burst too: its dispatch overlaps the GPU
        holders, bursts, host = {}, {}, {}
        for name, (tx, path) in paths.items():
            jitted = jax.jit(make(tx, path), donate_argnums=(0, 1))
            # the gradients are arguments: closed over, XLA would compile them in as constants
            holder = holders[name] = [_fresh(w), _with_moments(tx.init(w), m1, m2)]
            print(f"{name}, {mode}: executable {_entry_ops(jitted, *holder, g)}", flush=True)

            def burst(jitted=jitted, holder=holder, host=host.setdefault(name, [])):
                t = time.perf_counter()
                for _ in range(n_calls):
                    holder[:] = jitted(*holder, g)
                host.append((time.perf_counter() - t) / n_calls)  # the host's share (on a GPU)
                return holder
            bursts[name] = (burst, n_calls * per)
        for name, s in _interleaved(bursts, jax.block_until_ready).items():
            out[name][mode] = s
            print(f"{name}, {mode}: {s * 1e6:.1f} µs a step, of which the host's enqueueing "
                  f"{statistics.median(host[name]) * 1e6:.1f} µs a call", flush=True)
        holders.clear()  # frees the buffers before the next mode
        bursts.clear()
    return out


def _ort_api(w, g, m1, m2, calls, lr):
    """The ORT-API mirror's Optimizer over a state holding the parameters: per call (packed),
    in a loop (packed), and the per-name update per call."""
    from jaxops.onnx import artifacts
    from jaxops.onnx.checkpoint import Checkpoint
    from jaxops.onnx.packed import PackedState
    from jaxops.onnx.train_core import OptimizerModel, TrainState
    from jaxops.onnx.training import CheckpointState, Optimizer

    names = [f"p{i}" for i in range(len(w))]
    proto = types.SimpleNamespace(data_type=1)  # float
    model = artifacts._optimizer_model(artifacts.AdamW(), [proto], 17)

    def state():
        ts = TrainState(params=dict(zip(names, _fresh(w))), frozen={},
                        grads=dict(zip(names, _fresh(g))),
                        moments={n: {"momentum0": jnp.copy(a), "momentum1": jnp.copy(b)}
                                 for n, a, b in zip(names, m1, m2)}, step=np.int64(0))
        cs = CheckpointState(Checkpoint())
        cs.train_state, cs.initial_learning_rate = ts, lr
        return cs

    cs = state()
    # what Optimizer reads of a Module (_queued_small: no train step queued before it;
    # _at.device: where it runs, None for jax's default device)
    module = types.SimpleNamespace(core=types.SimpleNamespace(trained=names), state=cs,
                                   _trained=tuple(names), _queued_small=True,
                                   _at=types.SimpleNamespace(device=None))
    opt = Optimizer(model, module)
    out = {}

    def burst():
        for _ in range(calls):
            opt.step()
        return cs.block_until_ready()
    out["per call"] = _timed(burst, lambda x: x, calls)

    core = OptimizerModel(model, module.core)

    def loop(packed, lr):
        for _ in range(STEPS):
            packed = jax.lax.optimization_barrier(core.update_packed(packed, lr))
        return packed
    jitted = jax.jit(loop, donate_argnums=0)
    holder = [PackedState.pack(state().train_state, names).replace(step=jnp.int32(0))]

    def loop_burst():
        for _ in range(calls // STEPS):
            holder[0] = jitted(holder[0], np.float32(lr))
        return holder[0]
    out["loop"] = _timed(loop_burst, jax.block_until_ready, calls // STEPS * STEPS)
    holder.clear()

    by_name = jax.jit(core.update, donate_argnums=0)
    ts = [state().train_state.replace(step=jnp.int32(0))]

    def name_burst():
        for _ in range(calls):
            ts[0] = by_name(ts[0], np.float32(lr))
        return ts[0]
    out["per call, by name (before packing)"] = _timed(name_burst, jax.block_until_ready, calls)
    return out


def _torch_fused(w, g, m1, m2, calls, hp):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or jax.devices()[0].platform != "gpu":
        return None
    t = lambda x: torch.from_dlpack(jnp.copy(x))
    params = [torch.nn.Parameter(t(x)) for x in w]
    opt = torch.optim.AdamW(params, lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"],
                            weight_decay=hp["wd"], fused=True)
    for p, a, b, x in zip(params, m1, m2, g):
        p.grad = t(x)
        opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                        "exp_avg": t(a), "exp_avg_sq": t(b)}

    def burst():
        for _ in range(calls):
            opt.step()
    return {"per call": _timed(burst, lambda _: torch.cuda.synchronize(), calls)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.optim_api", description=__doc__)
    p.add_argument("--quick", action="store_true", help="GPT-2 tiny (seconds on a CPU)")
    args = p.parse_args(argv)
    import optax

    from bench import harness
    from bench.optim import B1, B2, EPS, LR, WD, _make_inputs, _split, gpt2_small_shapes
    from jaxops import optim as jo

    shapes = (gpt2_small_shapes(layers=2, d=64, vocab=512, ctx=64) if args.quick
              else gpt2_small_shapes())
    n, numel = len(shapes), sum(math.prod(s) for s in shapes)
    torch, _ = harness.load_torch()
    copy = harness.copy_bandwidth(harness.Settings.make(args.quick), torch)["bytes_per_s"]
    w, g, m1, m2 = _split(_make_inputs(shapes)(jax.random.key(0)), n)
    calls = 8 if args.quick else 20
    rows, t0 = {}, time.perf_counter()
    ours = jo.adamw(LR, B1, B2, EPS, weight_decay=WD)
    paths = {"optax.adamw update + apply_updates":
             (optax.adamw(LR, B1, B2, EPS, weight_decay=WD), "update"),
             "jaxops.optim.adamw update + apply_updates": (ours, "update"),
             "jaxops.optim.adamw .step": (ours, "step")}
    rows.update(_optax_like(paths, w, g, m1, m2, calls))
    print(f"({time.perf_counter() - t0:.0f} s)", flush=True)
    for mode, s in _ort_api(w, g, m1, m2, calls, LR).items():
        rows.setdefault("ORT-API Optimizer.step()", {})[mode] = s
    peer = _torch_fused(w, g, m1, m2, calls, dict(lr=LR, b1=B1, b2=B2, eps=EPS, wd=WD))
    if peer:
        rows["torch.optim.AdamW(fused=True)"] = peer
    step_bytes = 7 * 4 * numel
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"\nAdamW over {n} tensors, {numel / 1e6:.1f}M f32 parameters; device "
          f"{jax.devices()[0].device_kind}; copy {copy / 1e9:.0f} GB/s; {STEPS} steps a loop "
          f"call, bursts of {calls} calls\n")
    print("| path | mode | µs / step | GB/s | % of copy |")
    print("|---|---|---|---|---|")
    for name, modes in rows.items():
        for mode, s in modes.items():
            bw = step_bytes / s
            print(f"| {name} | {mode} | {s * 1e6:.1f} | {bw / 1e9:.0f} | {100 * bw / copy:.0f}% |")
    return rows


def cases(quick):  # not a harness family: its own table (python -m bench.optim_api)
    return []


if __name__ == "__main__":
    main()
