"""MaxPool/AveragePool's sliced form (handlers/pool.py's _sliced, _max_pool_with_indices)
against the gather form, on corpus forwards (`program.jit()`), the two compiled side by side
and called alternately:

    taskset -c 1 python tools/pool_ab.py [deeplabv3_ts,deeplabv3_dynamo] [reps]
    taskset -c 1 python tools/pool_ab.py --train [resnet_ts,resnet_dynamo] [reps]

prints each model's median call time per form (µs) and their ratio, on the CPU (other
platforms run the gather either way). --train times a training step instead (Module(*inputs),
Optimizer.step(), lazy_reset_grad(), as bench.cpu_corpus does): MaxPool with Indices."""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "corpus"


def _forward(name, max_taps):
    import jaxops.onnx as jo
    from jaxops.onnx.handlers import pool

    pool._MAX_TAPS = max_taps  # read when the forward is traced, at its first call
    f = jo.load(CORPUS / name / "forward.onnx").jit()
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    return f, x, np.asarray(f(x))


def _train_step(name, max_taps):
    import json

    from jaxops.onnx.handlers import pool
    from jaxops.onnx.training import CheckpointState, Module, Optimizer

    d = CORPUS / name
    ref = json.loads((d / "reference.json").read_text())
    data = np.load(d / "reference.npz")
    inputs = [data[f"in_{n}"][0] for n in ref["inputs"]]
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(str(d / "training_model.onnx"), state, str(d / "eval_model.onnx"), "cpu")
    optimizer = Optimizer(str(d / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(ref["lr"])

    class _Step:  # block_until_ready() as the loop below calls it
        def block_until_ready(self):
            state.block_until_ready()

    def step(_):
        module(*inputs)
        optimizer.step()
        module.lazy_reset_grad()
        return _Step()

    pool._MAX_TAPS = max_taps  # read when the step is traced, at its first call
    loss = np.asarray(module(*inputs))  # traces (and runs) the step with this form
    optimizer.step()
    module.lazy_reset_grad()
    return step, None, loss


def main(*args):
    train = "--train" in args
    args = [a for a in args if a != "--train"]
    names = args[0] if args else ("resnet_ts,resnet_dynamo" if train else
                                  "deeplabv3_ts,deeplabv3_dynamo")
    reps = args[1] if len(args) > 1 else "1000"
    build = _train_step if train else _forward
    for name in names.split(","):
        (fg, x, yg), (fs, _, ys) = build(name, 0), build(name, 64)
        print(f"{name}: max |sliced - gathered| {float(np.abs(ys - yg).max()):.2e}"
              + (" (first step's loss)" if train else ""))
        times = {"gather": [], "sliced": []}
        for i in range(int(reps) + 50):
            for key, f in (("gather", fg), ("sliced", fs)):
                t0 = time.perf_counter()
                f(x).block_until_ready()
                if i >= 50:  # warm-up calls are not counted
                    times[key].append(time.perf_counter() - t0)
        g, s = (statistics.median(times[k]) * 1e6 for k in ("gather", "sliced"))
        print(f"  gather {g:.1f} us, sliced {s:.1f} us, sliced/gather {s / g:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
