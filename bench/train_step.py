"""Train-step time: an ORT training graph run by jaxops vs the same model in PyTorch (eager
and torch.compile).

    python -m bench.train_step [--quick | --size 46m|124m] [--precision f32,tf32,bf16|both|all]
                               [--impls fused,api,torch,compile] [--out PATH.json]

The model is bench/_transformer.py's transformer (pre-norm encoder layers: LayerNorm, softmax
attention, GELU MLP; a mean-pooled classifier head; CrossEntropyLoss), the one the
tests/data/transformer fixture is made from, at the size in bench/data/<size>/config.json:
6 layers, d=768, 12 heads, MLP 3072, seq 512, batch 16, 46M parameters (--quick: 2 layers,
d=64, seq 32, batch 4, for CPU; --size 124m: GPT-2-small-sized, 12 layers, d=768, vocab
50304, seq 1024, batch 8, 124M parameters). Its ORT training artifacts (`tools/make_artifacts.py --bench`)
are the graphs only: both sides start from the same fresh parameters (torch's default init
under a fixed seed) and train on the same random batches.

Each implementation runs full training steps (forward, backward, AdamW update, no gradient
accumulation):

  jaxops fused  training_model.onnx and optimizer_model.onnx imported by jaxops, run in ONE
                jax.jit per step (jaxops.onnx.train_core.Trainer.step), the state donated
                (updated in place)
  jaxops API    jaxops.onnx.training as a migrated ORT script runs it: module(x, y);
                optimizer.step(); module.lazy_reset_grad() (two jitted calls per step)
  torch eager   the same nn.Module, F.cross_entropy, torch.optim.AdamW (fused on CUDA) with
                the optimizer graph's betas, epsilon and weight decay; zero_grad(set_to_none)
  torch compile the same, the forward and loss through torch.compile (default mode), the
                backward compiled with it (AOTAutograd), the fused AdamW eager

ORT's AdamWOptimizer (adam_mode 1) adds epsilon to sqrt(m2) before the bias correction,
torch after it: the same work, but different updates where gradients are near epsilon. So
the run judges the first step's loss (same parameters, same batch: TOL) and reports the next
steps' (1e-4 apart at the quick size); with epsilon negligible both are the same update and
the losses of the first steps agree to f32 rounding (tests/test_bench_train_step.py).

Timing, after warm-up (the first steps also compile and check the losses), medians:
  step      bursts of steps with one sync at the end, wall time / steps: the step time a
            training loop sees (the headline; jax's and torch's host work overlaps the GPU)
  synced    single steps, each followed by a sync: adds the dispatch and sync latency
  dispatch  host time until the step call returns: jax dispatching its jitted call(s),
            torch eager launching every kernel of the step
  events    torch on CUDA: CUDA-event time of single steps in a burst
Precision: the ORT graph is f32 (generate_artifacts has no mixed precision). "f32" runs
full-f32 matmuls on both sides (jax "float32", torch "highest": torch's default); "tf32"
TF32 tensor-core matmuls on both (jax "tensorfloat32", what jax does on a GPU by default;
torch "high"); "bf16" mixed precision: jaxops loads the training graph with
precision="bf16" (jaxops/onnx/precision.py), torch runs the forward and loss under
torch.autocast("cuda"/"cpu", torch.bfloat16); parameters, gradients and AdamW stay f32 on
both sides.
"""
from __future__ import annotations

import os

# Before jax is imported: allocate on demand (torch shares the GPU in the same process).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

try:  # the importer needs onnx (the `onnx` extra); `python -m bench` imports this module
    import onnx

    from jaxops.onnx import checkpoint as ckpt_format
    from jaxops.onnx import train_core, training
except ImportError as e:
    onnx = None
    _MISSING = str(e)

DATA = Path(__file__).resolve().parent / "data"
SIZES = {"46m": "transformer_l6_d768_s512_b16", "124m": "transformer_l12_d768_s1024_b8",
         "quick": "transformer_l2_d64_s32_b4"}
SEED = 0
LR = 1e-4
BATCHES = 4        # distinct batches, rotated
CHECK_STEPS = 3    # first steps whose losses are compared across implementations
# the first step's loss (same parameters, same batch: the forward) of two implementations,
# relative; later steps are reported, not judged: AdamW's epsilon (module docstring)
TOL = {"f32": 1e-4, "tf32": 1e-2, "bf16": 2e-2}
PRECISIONS = ("f32", "tf32", "bf16")
JAX_PRECISION = {"f32": "float32", "tf32": "tensorfloat32", "bf16": "tensorfloat32"}
BUF = "_grad.accumulation.buffer"


def cases(quick: bool) -> list:
    """Not a per-op case of `python -m bench`: a train step is timed by this module's own
    command (`python -m bench.train_step`), which reports dispatch and step times."""
    return []


# ----------------------------------------------------------------------------------------
# the model, the data, the initial parameters


def load_size(quick: bool, directory: Path | None = None, size: str = "46m"
              ) -> tuple[Path, dict]:
    d = directory or DATA / SIZES["quick" if quick else size]
    return d, json.loads((d / "config.json").read_text())


def initial_params(torch, config: dict) -> dict[str, np.ndarray]:
    """torch's default initialisation of the model under a fixed seed, as numpy arrays."""
    from bench._transformer import Transformer
    torch.manual_seed(SEED)
    model = Transformer(**_arch(config))
    return {k: v.detach().numpy().copy() for k, v in model.named_parameters()}


def _arch(config):
    return {k: config[k] for k in ("vocab", "dim", "heads", "hidden", "layers", "classes", "seq")}


def batches(config: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random token ids, labelled by the first token's id (a learnable rule)."""
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(BATCHES):
        ids = rng.integers(0, config["vocab"], (config["batch"], config["seq"]))
        out.append((ids.astype(np.int64), (ids[:, 0] % config["classes"]).astype(np.int64)))
    return out


def adamw_attributes(directory: Path) -> dict:
    """The AdamWOptimizer node's hyperparameters, for torch's AdamW."""
    (node,) = [n for n in onnx.load(str(directory / "optimizer_model.onnx")).graph.node
               if n.op_type == "AdamWOptimizer"]
    a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
    return {"betas": (a.get("alpha", 0.9), a.get("beta", 0.999)), "eps": a.get("epsilon", 1e-8),
            "weight_decay": a.get("weight_decay", 0.01), "adam_mode": a.get("adam_mode", 0)}


def flops_per_step(config: dict) -> float:
    """Matmul FLOPs of forward + backward (3x the forward's): per layer, forward, the dense
    layers' 2 * tokens * weights and attention's 4 * batch * seq^2 * dim (the head's are
    negligible)."""
    d, h, layers = config["dim"], config["hidden"], config["layers"]
    tokens = config["batch"] * config["seq"]
    dense = 2 * tokens * (4 * d * d + 2 * d * h)
    attention = 4 * config["batch"] * config["seq"] ** 2 * d
    return 3 * layers * (dense + attention)


# ----------------------------------------------------------------------------------------
# implementations: step(ids, labels) -> loss (not waited for); sync() waits for the state


class JaxFused:
    """The training graph and the optimizer graph in one jitted, donated step
    (jaxops.onnx.train_core's Trainer.step)."""

    name = "jaxops fused"

    def __init__(self, directory: Path, params: dict, device, precision=None):
        state = train_core.TrainState.from_checkpoint(ckpt_format.Checkpoint(trainable=params))
        model = train_core.TrainingModel(directory / "training_model.onnx", state,
                                         precision=precision)
        if sorted(model.trained) != sorted(params):
            raise ValueError(f"the training graph trains {sorted(model.trained)}, the torch "
                             f"model has {sorted(params)}")
        optimizer = train_core.OptimizerModel(directory / "optimizer_model.onnx", model)
        self._step = jax.jit(train_core.Trainer(model, optimizer).step, donate_argnums=0)
        # the step count too lives on the device, so a step's inputs are all there
        self.state = jax.device_put(optimizer.init(model.init(state)), device)
        self.lr = jax.device_put(np.float32(LR), device)
        self.device = device

    def put(self, ids, labels):
        return jax.device_put((ids.astype(np.int32), labels.astype(np.int32)), self.device)

    def __call__(self, ids, labels):
        (loss, *_), self.state = self._step(self.state, [ids, labels], self.lr)
        return loss

    def sync(self, loss):
        jax.block_until_ready((loss, self.state))


class JaxAPI:
    """jaxops.onnx.training, used as ORT's training API is."""

    name = "jaxops API"

    def __init__(self, directory: Path, params: dict, device, precision=None):
        self.state = training.CheckpointState(ckpt_format.Checkpoint(trainable=dict(params)))
        self.module = training.Module(directory / "training_model.onnx", self.state,
                                      device=device, precision=precision)
        self.optimizer = training.Optimizer(directory / "optimizer_model.onnx", self.module)
        self.optimizer.set_learning_rate(LR)
        self.module.lazy_reset_grad()
        self.device = device

    def put(self, ids, labels):
        return jax.device_put((ids.astype(np.int32), labels.astype(np.int32)), self.device)

    def __call__(self, ids, labels):
        loss = self.module(ids, labels)
        self.optimizer.step()
        self.module.lazy_reset_grad()
        return loss

    def sync(self, loss):
        # the state's device arrays (Parameter.data would copy them to the host)
        jax.block_until_ready((loss, self.state.train_state))


class TorchEager:
    name = "torch eager"

    def __init__(self, torch, config: dict, params: dict, adamw: dict, device: str,
                 autocast: bool = False):
        from bench._transformer import Transformer
        self.torch, self.device, self.autocast = torch, device, autocast
        self.model = Transformer(**_arch(config)).to(device)
        with torch.no_grad():
            for k, p in self.model.named_parameters():
                p.copy_(torch.from_numpy(params[k]))
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=adamw["betas"],
                                     eps=adamw["eps"], weight_decay=adamw["weight_decay"],
                                     fused=device == "cuda")
        self.loss = self._loss

    def _loss(self, ids, labels):
        with self.torch.autocast(self.device, self.torch.bfloat16, enabled=self.autocast):
            return self.torch.nn.functional.cross_entropy(self.model(ids), labels)

    def put(self, ids, labels):
        return (self.torch.from_numpy(ids).to(self.device),
                self.torch.from_numpy(labels).to(self.device))

    def __call__(self, ids, labels):
        loss = self.loss(ids, labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def sync(self, loss):
        if self.device == "cuda":
            self.torch.cuda.synchronize()


class TorchCompile(TorchEager):
    """torch.compile of the forward and loss (autocast inside the compiled function): the
    backward is compiled with it; the optimizer is the same fused AdamW."""

    name = "torch compile"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss = self.torch.compile(self._loss)


# ----------------------------------------------------------------------------------------
# timing


def _median_ms(xs):
    return statistics.median(xs) * 1e3


def measure(impl, data, *, warmup: int, steps: int, burst: int, trials: int, torch=None) -> dict:
    """The first CHECK_STEPS losses (synced: they compile), then the timings (docstring)."""
    data = [impl.put(*b) for b in data]
    n = len(data)
    losses = []
    for i in range(CHECK_STEPS):
        losses.append(float(impl(*data[i % n])))
    loss = None
    for i in range(warmup):
        loss = impl(*data[i % n])
    impl.sync(loss)
    synced, dispatch = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = impl(*data[i % n])
        t1 = time.perf_counter()
        impl.sync(loss)
        synced.append(time.perf_counter() - t0)
        dispatch.append(t1 - t0)
    bursts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for i in range(burst):
            loss = impl(*data[i % n])
        impl.sync(loss)
        bursts.append((time.perf_counter() - t0) / burst)
    res = {"first_losses": losses, "step_ms": _median_ms(bursts), "synced_ms": _median_ms(synced),
           "dispatch_ms": _median_ms(dispatch), "burst": burst, "trials": trials,
           "steps": steps, "last_loss": float(loss)}
    if torch is not None:
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(burst * trials)]
        for i, (a, b) in enumerate(pairs):
            a.record()
            impl(*data[i % n])
            b.record()
        torch.cuda.synchronize()
        res["events_ms"] = statistics.median(a.elapsed_time(b) for a, b in pairs)
    return res


IMPLS = {"fused": JaxFused.name, "api": JaxAPI.name, "torch": TorchEager.name,
         "compile": TorchCompile.name}
TORCH = (TorchEager.name, TorchCompile.name)


PROFILE_STEPS = 3


def profile(impl, data, out: Path, torch=None, kernels=None) -> None:
    """PROFILE_STEPS steps under jax's or torch's profiler (after measure(): compiled, warm):
    out/ gets the trace (jax: plugins/profile/<time>/perfetto_trace.json.gz; torch:
    trace.json; both open in ui.perfetto.dev) and ops.txt, the time per op or kernel summed
    over the steps. kernels: torch, to also list a jax step's GPU kernels (XLA's fusions,
    jaxops' FFI kernels) through torch's profiler, which sees every kernel of the process
    (jax's own device tracer can fail where torch holds CUPTI): kernels.txt."""
    out.mkdir(parents=True, exist_ok=True)
    data = [impl.put(*b) for b in data]
    if torch is None:
        try:
            with jax.profiler.trace(str(out), create_perfetto_trace=True):
                for i in range(PROFILE_STEPS):
                    loss = impl(*data[i % len(data)])
                impl.sync(loss)
            trace = max(out.glob("plugins/profile/*/perfetto_trace.json.gz"))  # the newest
            (out / "ops.txt").write_text(_trace_summary(trace))
        finally:
            if kernels is not None:
                _torch_kernels(kernels, impl, data, out)
        return
    from torch.profiler import ProfilerActivity
    gpu = torch.cuda.is_available() and jax.default_backend() == "gpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(PROFILE_STEPS):
            loss = impl(*data[i % len(data)])
        impl.sync(loss)
    prof.export_chrome_trace(str(out / "trace.json"))
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    (out / "ops.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=60) + "\n")


def _torch_kernels(torch, impl, data, out: Path) -> None:
    from torch.profiler import ProfilerActivity
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(PROFILE_STEPS):
            loss = impl(*data[i % len(data)])
        impl.sync(loss)
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=80,
                                      max_name_column_width=90)
    (out / "kernels.txt").write_text(f"{PROFILE_STEPS} steps\n{table}\n")


def _trace_summary(path: Path, top: int = 60) -> str:
    """Time per event name, summed, for each device (the host's XLA ops on CPU), largest
    first; the Python tracer's events ("$file:line") are left out."""
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in process.items() if name.startswith("/device:")}
    keep = devices or set(process)
    total: dict = collections.defaultdict(float)
    count: dict = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["pid"] in keep and not e["name"].startswith("$"):
            key = (process.get(e["pid"], "?"), e["name"])
            total[key] += e.get("dur", 0.0)
            count[key] += 1
    lines = [f"{PROFILE_STEPS} steps; us summed per name ({'devices' if devices else 'host'})",
             f"{'us':>12} {'calls':>6}  process  name"]
    for (proc, name), us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{us:12.1f} {count[(proc, name)]:6d}  {proc}  {name}")
    return "\n".join(lines) + "\n"


def run_precision(precision, impls, directory, config, params, data, adamw, torch, settings,
                  log, profile_dir=None):
    gpu = jax.default_backend() == "gpu"
    jax_device = jax.devices()[0]
    mixed = "bf16" if precision == "bf16" else None
    torch_args = (torch, config, params, adamw, "cuda" if gpu else "cpu", mixed is not None)
    builders = {JaxFused.name: lambda: JaxFused(directory, params, jax_device, mixed),
                JaxAPI.name: lambda: JaxAPI(directory, params, jax_device, mixed),
                TorchEager.name: lambda: TorchEager(*torch_args),
                TorchCompile.name: lambda: TorchCompile(*torch_args)}
    results = {}
    for name in impls:
        is_torch = name in TORCH
        if is_torch:  # "high": TF32 matmuls on CUDA (allow_tf32); "highest": f32
            torch.set_float32_matmul_precision("high" if precision != "f32" else "highest")
        t0 = time.perf_counter()
        impl = None
        try:
            with jax.default_matmul_precision(JAX_PRECISION[precision]):
                impl = builders[name]()
                r = measure(impl, data, **settings, torch=torch if is_torch and gpu else None)
                r["matmul_precision"] = (torch.get_float32_matmul_precision() if is_torch
                                         else jax.config.jax_default_matmul_precision)
                if profile_dir is not None:
                    where = profile_dir / f"{precision}-{name.replace(' ', '-')}"
                    profile(impl, data, where, torch if is_torch else None,
                            kernels=torch if gpu and not is_torch else None)
                    r["profile"] = str(where)
            log(f"  {name:13s} step {r['step_ms']:9.3f} ms  synced {r['synced_ms']:9.3f} ms  "
                f"dispatch {r['dispatch_ms']:8.3f} ms"
                + (f"  events {r['events_ms']:9.3f} ms" if "events_ms" in r else "")
                + f"  losses {', '.join(f'{x:.6f}' for x in r['first_losses'])}")
        except Exception as e:  # one failing implementation still leaves the others' rows
            r = {"error": f"{type(e).__name__}: {e}"[:500],
                 "traceback": traceback.format_exc()[-4000:]}
            log(f"  {name:13s} ERROR {r['error']}")
        r["wall_s"] = time.perf_counter() - t0
        results[name] = r
        del impl
        gc.collect()
        if is_torch and gpu:
            torch.cuda.empty_cache()
    return results


def agreement(results: dict, precision: str) -> dict:
    """Relative differences of the first losses from the torch ones (or else the first
    implementation's that ran); ok: all finite and the first within TOL."""
    ran = [n for n, r in results.items() if "error" not in r]
    if not ran:
        return {}
    ref_name = TorchEager.name if TorchEager.name in ran else ran[0]
    ref = np.asarray(results[ref_name]["first_losses"])
    out = {}
    for name, r in results.items():
        if name == ref_name:
            continue
        if "error" in r:
            out[name] = {"vs": ref_name, "ok": False, "error": r["error"]}
            continue
        rel = np.abs(np.asarray(r["first_losses"]) - ref) / np.abs(ref)
        finite = np.all(np.isfinite(r["first_losses"] + [r["last_loss"]]))
        out[name] = {"vs": ref_name, "rel_diff": rel.tolist(), "tol": TOL[precision],
                     "ok": bool(finite and np.all(np.isfinite(ref)) and rel[0] <= TOL[precision])}
    return out


def table(report: dict) -> str:
    env, cfg = report["environment"], report["config"]
    lines = [f"### Train step — {cfg['name']} ({cfg['params'] / 1e6:.1f}M params, batch "
             f"{cfg['batch']} x seq {cfg['seq']}), {env['device']} ({env['backend']}), "
             f"{env['date'][:10]}{' — QUICK' if report['quick'] else ''}", "",
             f"jax {env['jax']}, jaxlib {env['jaxlib']}, torch {env['torch']}, jaxops "
             f"{env['jaxops']} ({env['jaxops_git'] or 'no git'}). ms per step (forward, "
             f"backward, AdamW): medians; step = bursts of {report['settings']['burst']} steps "
             f"with one sync; synced = one step + sync; dispatch = host time of the step call; "
             f"events = CUDA events. TFLOP/s from {report['flops_per_step'] / 1e12:.3g} TFLOP "
             f"of matmuls per step.", "",
             "| precision | implementation | step ms | TFLOP/s | synced ms | dispatch ms "
             "| events ms | vs torch (step) | vs compile | first losses agree |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for precision, block in report["results"].items():
        torch_ms = block["timings"].get(TorchEager.name, {}).get("step_ms")  # None: failed
        compile_ms = block["timings"].get(TorchCompile.name, {}).get("step_ms")
        for name, r in block["timings"].items():
            if "error" in r:
                lines.append(f"| {precision} | {name} | ERROR: {r['error'][:200]} ||||||||")
                continue
            agree = block["agreement"].get(name)
            agree_txt = "(reference)" if agree is None else (
                f"{'yes' if agree['ok'] else 'NO'} (rel. diff. {agree['rel_diff'][0]:.0e}, "
                f"then <= {max(agree['rel_diff'][1:]):.0e})")
            speed = (f"{torch_ms / r['step_ms']:.2f}x" if torch_ms and name != TorchEager.name
                     else "–")
            vs_compile = (f"{compile_ms / r['step_ms']:.2f}x"
                          if compile_ms and name != TorchCompile.name else "–")
            events = f"{r['events_ms']:.3f}" if "events_ms" in r else "–"
            lines.append(f"| {precision} | {name} | {r['step_ms']:.3f} | "
                         f"{report['flops_per_step'] / (r['step_ms'] * 1e-3) / 1e12:.3g} | "
                         f"{r['synced_ms']:.3f} | {r['dispatch_ms']:.3f} | {events} | {speed} | "
                         f"{vs_compile} | {agree_txt} |")
    lines += ["", "vs torch / vs compile: PyTorch eager's / torch.compile's step time (same "
              "precision) / this one's (>= 1: no slower)."
              f" Losses: the first {CHECK_STEPS} steps' vs the reference's, from the same "
              "parameters on the same batches (the first step: the forward alone)."]
    if report.get("torch_skipped"):
        lines.append(f"(torch skipped: {report['torch_skipped']})")
    return "\n".join(lines)


def load_torch():
    try:
        import torch
    except Exception as e:
        return None, f"torch not importable: {e}"
    if jax.default_backend() == "gpu" and not torch.cuda.is_available():
        return None, "jax runs on the GPU but torch.cuda is not available"
    return torch, None


def run(quick: bool, precisions: list[str], *, impls=("fused", "api", "torch"),
        directory: Path | None = None, settings: dict | None = None,
        profile_dir: Path | None = None, log=print, size: str = "46m") -> dict:
    """The benchmark: a report dict (its "table" is the markdown). impls: keys of IMPLS;
    profile_dir: also profile each implementation (profile()) into a folder of it."""
    from bench import harness
    if onnx is None:
        raise SystemExit(f"bench.train_step needs the onnx extra: {_MISSING}")
    torch, why_not = load_torch()
    if why_not:
        log(f"torch peer skipped: {why_not}")
    impls = [IMPLS[k] for k in impls if k not in ("torch", "compile") or torch is not None]
    directory, config = load_size(quick, directory, size)
    if settings is None:
        settings = (dict(warmup=2, steps=5, burst=4, trials=2) if quick
                    else dict(warmup=5, steps=20, burst=10, trials=5))
    if torch is None:
        params = _params_without_torch(directory)
    else:
        params = initial_params(torch, config)
    data = batches(config)
    adamw = adamw_attributes(directory)
    env = harness.environment(torch if torch is not None and jax.default_backend() == "gpu"
                              else None)
    if torch is not None:
        env["torch"] = torch.__version__
    report = {"quick": quick, "environment": env, "settings": settings, "torch_skipped": why_not,
              "config": {"name": directory.name, **config}, "adamw": adamw, "lr": LR,
              "flops_per_step": flops_per_step(config), "results": {}}
    log(f"{directory.name}: {config['params'] / 1e6:.1f}M parameters on {env['device']} "
        f"({env['backend']}); AdamW {adamw}")
    for precision in precisions:
        log(f"precision {precision}:")
        timings = run_precision(precision, impls, directory, config, params, data, adamw,
                                torch, settings, log, profile_dir)
        report["results"][precision] = {"timings": timings,
                                        "agreement": agreement(timings, precision)}
    report["table"] = table(report)
    return report


def _params_without_torch(directory: Path) -> dict[str, np.ndarray]:
    """Without torch (jax-only runs): N(0, 0.02) parameters of the graph's shapes, LayerNorm
    scales (norm*.weight) 1."""
    model = onnx.load(str(directory / "training_model.onnx"))
    rng = np.random.default_rng(SEED)
    shapes = {i.name[:-len(BUF)]: [d.dim_value for d in i.type.tensor_type.shape.dim]
              for i in model.graph.input if i.name.endswith(BUF)}
    return {n: (np.ones(s, np.float32) if "norm" in n and n.endswith("weight")
                else (0.02 * rng.standard_normal(s)).astype(np.float32)) for n, s in shapes.items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small model (CPU, seconds)")
    p.add_argument("--size", choices=["46m", "124m"], default="46m",
                   help="the model (without --quick): 46m (default) or 124m (GPT-2-small-sized)")
    p.add_argument("--precision",
                   help="comma list of f32, tf32, bf16, or both (f32,tf32) or all (default: "
                   "tf32,bf16 on a GPU, f32 on CPU)")
    p.add_argument("--impls", help=f"comma list of {', '.join(IMPLS)} (default: all on a GPU; "
                   "on CPU all but compile, whose inductor build takes minutes there)")
    p.add_argument("--profile", type=Path, metavar="DIR", help="also profile "
                   f"{PROFILE_STEPS} steps of each implementation: DIR/<precision>-<impl>/"
                   "{trace, ops.txt}")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/train_step-<time>"
                   ".json); the table also goes next to it as .md")
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    precision = args.precision or ("tf32,bf16" if gpu else "f32")
    precisions = {"both": ["f32", "tf32"], "all": list(PRECISIONS)}.get(
        precision, [x.strip() for x in precision.split(",") if x.strip()])
    if not precisions or set(precisions) - set(PRECISIONS):
        p.error(f"--precision: {precision!r} (choose from {', '.join(PRECISIONS)}, both, all)")
    if jax.default_backend() == "cpu":
        try:  # torch's spinning thread pool thrashes on a shared CPU: one thread is steadier
            import torch
            torch.set_num_threads(1)
        except ImportError:
            pass
    default = list(IMPLS) if gpu else [k for k in IMPLS if k != "compile"]
    impls = [x.strip() for x in args.impls.split(",") if x.strip()] if args.impls else default
    unknown = set(impls) - set(IMPLS)
    if unknown:
        p.error(f"--impls: unknown {sorted(unknown)} (choose from {', '.join(IMPLS)})")
    report = run(args.quick, precisions, impls=impls, profile_dir=args.profile, size=args.size)
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = (Path(__file__).resolve().parent / "results"
               / f"train_step-{stamp}{'-quick' if args.quick else ''}.json")
    from bench import harness
    harness.write(report, out)
    out.with_suffix(".md").write_text(report["table"] + "\n")
    print()
    print(report["table"])
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    bad = [f"{prec}/{name}" for prec, block in report["results"].items()
           for name, r in block["timings"].items()
           if "error" in r or not block["agreement"].get(name, {"ok": True})["ok"]]
    if bad:
        print(f"failed, or first losses disagree: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
