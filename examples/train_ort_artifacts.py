"""Train ONNX Runtime training artifacts in JAX: the README's main job.

    python examples/train_ort_artifacts.py [--model mlp|cnn|transformer] [--steps 1000]

Loads the artifacts that ORT's `generate_artifacts` made (bundled under tests/data/<model>/;
tools/make_artifacts.py regenerates them), trains them with jaxops' port of ORT's training
API (each step one jax.jit-compiled function with donated buffers), evaluates, and saves a
checkpoint in ORT's format that `onnxruntime.training.api.CheckpointState` loads.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

from jaxops.onnx.training import CheckpointState, LinearLRScheduler, Module, Optimizer

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["mlp", "cnn", "transformer"], default="transformer")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--artifacts", type=Path, help="artifact folder (default: the bundled one)")
    p.add_argument("--out", type=Path, default=Path("trained_checkpoint"))
    p.add_argument("--device", default=None, help="cpu or cuda (default: jax's default device)")
    args = p.parse_args()
    folder = args.artifacts or DATA / args.model

    data = np.load(folder / "data.npz")
    xs, ys = data["inputs"], data["labels"]
    train, held_out = range(len(xs) - 1), len(xs) - 1  # the last batch is never trained on

    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx",
                    device=args.device)
    optimizer = Optimizer(folder / "optimizer_model.onnx", module)
    scheduler = LinearLRScheduler(optimizer, warmup_step_count=args.steps // 10,
                                  total_step_count=args.steps, initial_lr=args.lr, ort_order=False)

    module.eval()
    before = float(module(xs[held_out], ys[held_out]))
    module.train()
    start = None
    for step in range(1, args.steps + 1):
        i = train[(step - 1) % len(train)]
        loss = module(xs[i], ys[i])
        optimizer.step()
        scheduler.step()
        module.lazy_reset_grad()
        if start is None:  # the first step compiles both jitted functions
            float(loss)
            start = time.perf_counter()
        if step % 10 == 0 or step == args.steps:
            rate = (step - 1) / max(time.perf_counter() - start, 1e-9)
            done = int(30 * step / args.steps)
            sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{args.steps} "
                             f"loss {float(loss):.4f}  {rate:.1f} steps/s")
            sys.stdout.flush()
    print()
    module.eval()
    after = float(module(xs[held_out], ys[held_out]))
    print(f"{args.model}: held-out loss {before:.4f} -> {after:.4f}")
    state.properties["steps"] = args.steps
    CheckpointState.save_checkpoint(state, args.out, include_optimizer_state=True)
    print(f"checkpoint (ORT format, optimizer state included): {args.out}")
    return 0 if after < before else 1


if __name__ == "__main__":
    sys.exit(main())
