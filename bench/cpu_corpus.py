"""CPU speed of the real-model corpus: jaxops against ONNX Runtime's training API.

    python -m bench.cpu_corpus [--models resnet_ts,regnet_dynamo] [--threads 1,all] [--reps N]
                               [--xla-conv] [--out PATH.json]

For each export of tests/data/corpus (tools/make_corpus.py's small configurations, batch 2):

  train    one training step as a migrated ORT script runs it: module(*inputs);
           optimizer.step(); module.lazy_reset_grad(). jaxops: jaxops.onnx.training's
           Module/Optimizer (jitted, state donated), synced on the loss (the optimizer
           step goes with the next call's train step, one jitted program: in a loop each
           call does one update and one train step, as ORT's calls do); ORT:
           onnxruntime-training's Module/Optimizer (the pybind layer: onnxruntime.training.api
           itself imports torch) on CPU. Only exports that ORT 1.19.2 can train.
  forward  the eval model (jaxops Module.eval() vs ORT's eval_step); for the exports ORT cannot
           train (forward_only in the manifest), forward.onnx: `jaxops.onnx.load(path).jit()`
           (the jitted forward, its params on the device and closed over) vs an
           InferenceSession.

Times are medians over --reps loops of BLOCK calls each after warm-up, jaxops' loops and
ORT's interleaved in one process (this machine's load moves both alike; the end says how);
the `first` column: the ratio of the medians of each loop's first timed call (the second call
after an idle wait, right after the other library's loop: what this bench timed until
2026-12-01). Each export runs at each thread setting in a process of its own, as a user's
script holds one model (after other corpus exports in the same process, DeepLabV3's forward at
all1 took 0.20-0.21 ms against 0.15-0.16 ms alone, ORT's 0.09-0.10 either way; 2026-11-28,
one run each):

  1    the worker process bound to one core (sched_setaffinity, before jax or ORT is
       imported: whatever threads either starts share that core), ORT's
       intra_op_num_threads = inter_op_num_threads = 1 and its jaxops counterpart,
       jaxops.configure_cpu(threads=1) (one intra-op thread, each call on the calling thread:
       on one core the hand-off to XLA's execute thread cost ~8 us a call, 2026-11-27).
       XLA_FLAGS do not bind it to one core: with --xla_cpu_multi_thread_eigen=false
       intra_op_parallelism_threads=1 jax 0.12 still ran
       a 2048x2048 matmul, a conv and an elementwise op at 1.8-2.0 CPU seconds per wall
       second on 2 cores (measured 2026-11-24), bound to one core at 1.0.
  all  both libraries' defaults (every core the process may use): jaxops' Module, placed on
       "cpu", moves itself to jaxops.cpu_device(1) (a one-thread XLA:CPU client) at its first
       call where its step is small (all of the corpus but ResNet), and program.jit()'s
       forward likewise.
  all1 every core for the process, ORT at its defaults, jaxops.configure_cpu(threads=1) (jax's
       default client with one XLA:CPU intra-op thread, each call run on the calling thread,
       and XLA's memory-minimizing scheduler).
The table's cpu/wall columns (CPU time of the process per wall second while timing each side)
show the threading each side really had.

--xla-conv times jaxops with every convolution as XLA's own (what it did before
ops.conv.windowed_conv): the before/after of that change.

The corpus models are tiny (widths 16-64, 32x32 images (ResNet 128x128), batch 2): their steps
take 0.4-20 ms, which is what a user meets with these files, not what full-size models cost;
at these sizes jaxops' per-call host work (two jitted calls a step) is a large part of its time.
Where it went (gpt2_ts, one core, 2026-11-24, us a call; ORT: train_step 242, optimizer 32,
eval 70): Module(...) 417 of which the jitted program 250 and a jax.device_put of the inputs
~170 (now gone: the steps' jit places them, in_shardings); eval 250, program ~100, device_put
~120; handing jit the PackedState dataclass cost 10-16 us a call more than dicts of its
buffers (now dicts); the optimizer 64, its AdamW kernel ~34. What is left is XLA:CPU's own:
~7 us a jitted call (~18 us bound to one core, where the result comes back from XLA's
execute thread: jax_cpu_enable_async_dispatch=False, a process-wide setting for the user,
brings a trivial call back to 7 us), programs of many small thunks (gpt2_ts's eval: ~70
fusions in ~95 us; its train program ~180 thunks), and the convolution models'
grouped/depthwise convolutions. The
compile options tried per function (xla_cpu_use_xnnpack, _use_onednn,
_enable_concurrency_optimized_scheduler, _experimental_xnn_graph_fusion_mode, _enable_fast_math,
_scheduler_type) and --xla_cpu_multi_thread_eigen=false moved gpt2_ts by under 2%.
Per-thunk times (jax.profiler.trace of a program compiled with compiler_options
{"xla_cpu_enable_xprof_traceme": True}) showed ConvNeXt's depthwise 7x7 sum fused into each of
its LayerNorm's three fusions and computed three times: windowed_conv now materializes a
depthwise sum once (ops.conv._materialized).
Then (gpt2_dynamo, bert_ts, one core, 2026-11-24, us a call, A/B in one process): the steps
close over the packed layouts (as jit's static argument they were hashed every call, 2 us);
lazy_reset_grad's flag, the optimizer's step count and learning rate go in as device arrays
(a numpy scalar argument cost 2-7 us: the rate alone 6.6 us); eval takes no gradient buffers.
XLA:CPU copies each matrix out of the packed buffer before its dot (gpt2_dynamo's eval: 9 copy
thunks); keeping the 2-D parameters as arrays of their own between eval calls (sliced once)
took gpt2_dynamo's and whisper_ts's eval 11% and 8% less but bert_ts's, mistral_ts's, t5_ts's,
vit_dynamo's and convnext_ts's 5-12% more (random call order, 800 calls): not done. Left:
numpy inputs cost ~7 us each in the eval call (gpt2_dynamo's three int64 ones: 111 vs 87 with
jax arrays; 64-byte aligned int32: 97; packed into one host buffer: no faster); a jitted call's
~16 us floor; the optimizer is XLA's call plus the AdamW kernel (gpt2_dynamo: 61 us; the same
update as an XLA fusion 61, a donated pass-through of its 4 buffers 15).
Interleaving costs each side some cache warmth (the same jaxops step timed right after another
jaxops step was 5-8% faster than right after ORT's), and at `all` ORT's intra-op threads spin
for ~30 ms after each call, one pinned to a core: a jaxops call timed then shared that core
(resnet_ts' train step 18.2 ms right after ORT's, 16.0 ms 30 ms later). So each loop starts
on idle threads with an untimed call of its own (_timed, _settle).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "corpus"
BLOCK = 8  # timed calls a loop (_timed)


def cases(quick):  # noqa: ARG001 (python -m bench's family protocol: not a harness family)
    return []


def _manifest():
    return json.loads((CORPUS / "manifest.json").read_text())["entries"]


def _ort():
    """onnxruntime-training's pybind layer, or None (with the reason printed)."""
    try:
        import onnxruntime.capi._pybind_state as capi
    except ImportError as e:
        print(f"onnxruntime is not importable ({e}): skipping")
        return None
    if not hasattr(capi, "Module"):
        print("onnxruntime without training support: skipping")
        return None
    capi.set_default_logger_severity(3)
    return capi


def _settle(limit=0.3):
    """Waits (up to limit seconds) until the process's threads stop using the CPU: ORT's
    intra-op threads spin after a call returns (resnet_ts at 2 threads: ~31 ms of CPU
    within 30 ms after its train step, one of them pinned to a core), and a call of the
    other library made meanwhile lost that core (jaxops' step 18.2 ms right after ORT's,
    16.0 ms 30 ms later; interleaved in one process, 2026-11-24)."""
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        c0 = time.process_time()
        time.sleep(0.005)
        if time.process_time() - c0 < 0.0005:
            return


def _timed(fns, reps, block=BLOCK):
    """Each fn's median seconds a call in a loop, the median of the first call of each loop,
    and the CPU time each used per wall second (about 1 when pinned to one thread). The fns
    take turns (interleaved, reps times), each running a loop of its own: on a process whose
    threads are idle (_settle), one untimed call, then `block` timed calls in a row, as a
    training loop calls a step. The loop's first timed call (the second call after the idle
    wait, the other library's calls just before it) is what this bench timed until
    2026-12-01: it met the caches and the branch predictors the other library left, and cost
    jaxops more than a call in a loop (gpt2_ts's train step at one core: 208 us in a loop
    alone, 248 us as that call without ORT, ~300 us beside ORT; ORT's 250, 266, ~300)."""
    times, first, cpu = [[] for _ in fns], [[] for _ in fns], [0.0 for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            _settle()
            fn()
            c0 = time.process_time()
            for j in range(block):
                t0 = time.perf_counter()
                fn()
                (first if j == 0 else times)[i].append(time.perf_counter() - t0)
            cpu[i] += time.process_time() - c0
    med = statistics.median
    return ([med(t) for t in times], [c / (sum(t) + sum(f)) for c, t, f in zip(cpu, times, first)],
            [med(f) for f in first])


def _inputs(name):
    import numpy as np
    ref = json.loads((CORPUS / name / "reference.json").read_text())
    data = np.load(CORPUS / name / "reference.npz")
    names = list(ref["inputs"])
    if ref.get("forward_only"):
        return ref, [data[f"in_{n}"][0] for n in names], None
    return ref, [data[f"in_{n}"][0] for n in names], names


def _session_options(ort, threads):
    opts = ort.SessionOptions()
    if threads == 1:
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
    return opts


def _trained(name, threads, reps, ort):
    """{train: (jaxops s, ORT s), forward: (jaxops s, ORT s)} of an export ORT trains."""
    import jax
    import numpy as np

    from jaxops.onnx.training import CheckpointState, Module, Optimizer
    d = CORPUS / name
    ref, inputs, _ = _inputs(name)
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(str(d / "training_model.onnx"), state, str(d / "eval_model.onnx"), "cpu")
    optimizer = Optimizer(str(d / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(ref["lr"])

    device = ort.OrtDevice(ort.OrtDevice.cpu(), ort.OrtDevice.default_memory(), 0)
    opts = _session_options(ort, threads)
    ort_state = ort.load_checkpoint(str(d / "checkpoint"))
    ort_module = ort.Module(str(d / "training_model.onnx"), ort_state, str(d / "eval_model.onnx"),
                            device, opts)
    ort_opt = ort.Optimizer(str(d / "optimizer_model.onnx"), ort_state, device, opts)
    ort_opt.set_learning_rate(ref["lr"])

    def ours():
        loss = module(*inputs)
        optimizer.step()  # issued with the next call's train step (Optimizer.step)
        module.lazy_reset_grad()
        jax.block_until_ready(loss)  # as ORT's calls return: a loop's calls each do a step

    def theirs():
        out = ort.OrtValueVector()
        ort_module.train_step([np.array(x) for x in inputs], out)  # ORT may write its inputs
        ort_opt.optimizer_step()
        ort_module.lazy_reset_grad()

    for _ in range(3):
        ours()
        theirs()
    train = _timed([ours, theirs], reps)

    module.eval()
    eval_inputs = inputs[:len(module.input_names())]

    def ours_eval():
        jax.block_until_ready(module(*eval_inputs))

    def theirs_eval():
        out = ort.OrtValueVector()
        ort_module.eval_step([np.array(x) for x in eval_inputs], out)

    for _ in range(3):
        ours_eval()
        theirs_eval()
    row = {"train": train, "forward": _timed([ours_eval, theirs_eval], reps)}
    # ORT's pybind Module/Optimizer keep a raw pointer to their CheckpointState (no reference)
    # and ~Module writes through it: they go first. At return Python frees the locals first,
    # the state before the closures' Module, and that write landed in freed memory (glibc
    # aborted "corrupted size vs. prev_size" where jax shared the process: scratch A/B runs).
    ort_opt = ort_module = None  # the closures hold them: released here, before the state
    return row


def _forward_only(name, threads, reps, ort):
    """{forward: (jaxops s, ORT s)} of forward.onnx (an export ORT cannot train)."""
    import jax

    from jaxops.onnx import load
    path = CORPUS / name / "forward.onnx"
    _, inputs, _ = _inputs(name)
    program = load(str(path))
    forward = program.jit()  # the params fixed and on the device: a call takes the inputs
    import onnxruntime
    sess = onnxruntime.InferenceSession(str(path), _session_options(onnxruntime, threads),
                                        providers=["CPUExecutionProvider"])
    feed = dict(zip([i.name for i in sess.get_inputs()], inputs))

    def ours():
        jax.block_until_ready(forward(*inputs))

    def theirs():
        sess.run(None, feed)

    for _ in range(3):
        ours()
        theirs()
    return {"forward": _timed([ours, theirs], reps)}


def _xla_convolutions_only():
    """Every convolution as XLA's own (lax.conv_general_dilated), also grouped ones on the
    CPU: jaxops before ops.conv.windowed_conv, for comparison."""
    from jax import lax

    from jaxops.onnx.handlers import conv as handlers
    from jaxops.ops import conv

    def xla(x, w, strides, padding, dilations, group, lhs_dilation=None,
            precision=lax.Precision.HIGHEST, dense=False):
        sp = "DHW"[-(x.ndim - 2):]
        return lax.conv_general_dilated(
            x, w, strides, padding, lhs_dilation=lhs_dilation, rhs_dilation=dilations,
            dimension_numbers=("NC" + sp, "OI" + sp, "NC" + sp), feature_group_count=group,
            precision=precision)
    conv.conv_general = handlers.conv_general = xla


def _worker(models, threads, reps, xla_conv):
    """Runs in the subprocess of one thread setting: one JSON line per model (main runs one
    model a subprocess; --worker takes several)."""
    if xla_conv:
        _xla_convolutions_only()
    import warnings
    warnings.filterwarnings("ignore", message=".*int64.*")  # int64 graph inputs without x64
    ort = _ort()
    if ort is None:
        return
    manifest = _manifest()
    for name in models:
        try:
            if manifest[name]["status"] == "ok":
                row = _trained(name, threads, reps, ort)
            else:
                row = _forward_only(name, threads, reps, ort)
        except Exception as e:  # noqa: BLE001 (reported in the table)
            row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        print(json.dumps({"model": name, "threads": threads, **row}), flush=True)


def _run(models, threads, reps, xla_conv, sync_dispatch=False):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if threads == 1:
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "bench.cpu_corpus", "--worker", "--threads", str(threads),
           "--reps", str(reps), "--models", ",".join(models)] + ["--xla-conv"] * xla_conv
    cmd += ["--sync-dispatch"] * sync_dispatch
    root = Path(__file__).resolve().parent.parent
    rows = []
    with subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, text=True) as p:
        for line in p.stdout:
            if line.startswith("{"):
                rows.append(json.loads(line))
                _print_row(rows[-1])
            else:
                print(line, end="")
    return rows


def _print_row(r):
    label = f"{r['model']:<20} {str(r['threads']):>3}"
    if "error" in r:
        print(f"{label}  error: {r['error']}", flush=True)
        return
    for kind in ("train", "forward"):
        if kind in r:
            (ours, theirs), (c_ours, c_theirs), (f_ours, f_theirs) = _cells(r[kind])
            print(f"{label}  {kind:<7} {1e3 * ours:9.2f} {1e3 * theirs:9.2f} "
                  f"{ours / theirs:6.2f}   {c_ours:4.2f} {c_theirs:4.2f}   "
                  f"{f_ours / f_theirs:6.2f}", flush=True)


def _cells(cell):
    """(loop medians, cpu/wall, first-call medians) of a row's cell; rows written before
    2026-12-01 have no first-call medians: their medians are those."""
    return (*cell, cell[0]) if len(cell) == 2 else cell


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.cpu_corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", help="comma list of corpus exports (default: every one that "
                   "ORT trains, then the forward-only ones)")
    p.add_argument("--threads", default="1,all,all1", help="comma list of 1, all and all1")
    p.add_argument("--reps", type=int, default=15, help="timed calls per implementation")
    p.add_argument("--out", type=Path, help="also write the rows as JSON here")
    p.add_argument("--xla-conv", action="store_true", help="every convolution as XLA's own, "
                   "grouped ones on the CPU too (jaxops before ops.conv.windowed_conv)")
    p.add_argument("--sync-dispatch", action="store_true", help="jaxops' process with "
                   "jax_cpu_enable_async_dispatch off (a user's process-wide choice: each "
                   "call runs on the calling thread)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    manifest = _manifest()
    runnable = {k for k, v in manifest.items() if v["status"] in ("ok", "forward_only")
                and ((CORPUS / k / "forward.onnx").exists() or v["status"] == "ok")}
    if args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in models if m not in runnable]
        if unknown:
            p.error(f"not runnable corpus exports: {unknown} (have {sorted(runnable)})")
    else:
        models = sorted(runnable, key=lambda k: (manifest[k]["status"] != "ok", k))
    threads = [t.strip() for t in args.threads.split(",")]
    if any(t not in ("1", "all", "all1") for t in threads):
        p.error("--threads takes 1, all and all1")
    threads = [1 if t == "1" else t for t in threads]
    if args.worker:
        if threads[0] == 1:  # before jax and ORT make their thread pools
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        if threads[0] in (1, "all1"):  # before jax makes its CPU client
            import jaxops
            jaxops.configure_cpu(threads=1)
        if args.sync_dispatch:  # before jax makes its CPU client
            import jax
            jax.config.update("jax_cpu_enable_async_dispatch", False)
        _worker(models, threads[0], args.reps, args.xla_conv)
        return 0
    if _ort() is None:
        return 0
    print(f"{'model':<20} {'thr':>3}  {'step':<7} {'jaxops':>9} {'ORT':>9} {'ratio':>6}   "
          "cpu/wall (jaxops ORT)   first   ms: medians in loops, ratio: jaxops / ORT")
    rows = []
    for t in threads:
        for m in models:
            rows += _run([m], t, args.reps, args.xla_conv, args.sync_dispatch)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print("\n" + markdown(rows))
    return 0


def markdown(rows) -> str:
    """The rows as a markdown table (what `python -m bench.all` gathers)."""
    out = [f"ms medians of calls in loops of {BLOCK}, jaxops' loops and ORT's interleaved; ratio "
           "jaxops / ORT; cpu/wall: CPU seconds per wall second (jaxops, ORT); first: the ratio "
           "of each loop's first timed call (the second after an idle wait)", "",
           "| model | threads | step | jaxops ms | ORT ms | ratio | cpu/wall | first |",
           "|---|---|---|---:|---:|---:|---|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['threads']} | error: {r['error']} | | | | | |")
            continue
        for kind in ("train", "forward"):
            if kind in r:
                (ours, theirs), (c_ours, c_theirs), (f_ours, f_theirs) = _cells(r[kind])
                out.append(f"| {r['model']} | {r['threads']} | {kind} | {1e3 * ours:.2f} | "
                           f"{1e3 * theirs:.2f} | {ours / theirs:.2f} | "
                           f"{c_ours:.2f} {c_theirs:.2f} | {f_ours / f_theirs:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
