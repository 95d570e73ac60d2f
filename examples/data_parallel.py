"""Data-parallel training of ONNX Runtime training artifacts over all local devices.

    python examples/data_parallel.py [--model mlp|transformer] [--steps 20]

On a CPU-only machine, make several devices out of the CPU first:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/data_parallel.py

Loads the artifacts that ORT's `generate_artifacts` made (bundled under tests/data/<model>/),
and trains them with `jaxops.onnx.data_parallel.DataParallel`: every device runs the training
graph on its slice of the batch, the gradients are summed in one NcclAllReduce
(`jaxops.ops.nccl_all_reduce`: NCCL on GPUs, XLA's in-process collectives on CPU) and
averaged, and every device applies the optimizer graph, so the parameters stay identical
everywhere. Each device takes one bundled batch of 8 per step (the exported graphs fix the
batch size in some Reshape nodes), so the global batch is 8 x the number of devices.

Several hosts (or several processes on one host): start the same command in every process
with the coordinator's address, the number of processes and this process's index; each
process then drives its local devices, and the mesh spans the devices of all processes:

    # host 0                                      # host 1
    python examples/data_parallel.py \\            python examples/data_parallel.py \\
        --coordinator 10.0.0.1:1234 \\                 --coordinator 10.0.0.1:1234 \\
        --num-processes 2 --process-id 0              --num-processes 2 --process-id 1

which calls `jax.distributed.initialize(coordinator, num_processes, process_id)` before
anything else touches the devices (on a cluster manager that JAX knows, such as SLURM, the
three flags can be left out and `--distributed` given instead). Every process loads the
same data and passes the same global batch; DataParallel places each device's slice. On CPU
the processes talk through gloo (set below); on GPUs through NCCL.
"""
import argparse
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--artifacts", type=Path, help="artifact folder (default: the bundled one)")
    p.add_argument("--coordinator", help="host:port of process 0, for several processes")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--distributed", action="store_true",
                   help="jax.distributed.initialize() with the cluster's own settings")
    args = p.parse_args(argv)

    import jax
    if args.coordinator or args.distributed:
        # CPU devices of different processes talk through gloo (GPUs use NCCL regardless)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import numpy as np

    from jaxops.onnx.data_parallel import DataParallel
    from jaxops.onnx.training import CheckpointState, Module, Optimizer

    folder = args.artifacts or DATA / args.model
    data = np.load(folder / "data.npz")
    xs, ys = data["inputs"], data["labels"]
    devices = jax.device_count()
    if devices > len(xs):
        raise SystemExit(f"{devices} devices but only {len(xs)} batches of data")

    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, device=None)
    optimizer = Optimizer(folder / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(args.lr)
    trainer = DataParallel(module, optimizer)  # a mesh of all devices, axis "data"
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(f"{args.model}: {devices} device(s) in {jax.process_count()} process(es), global "
        f"batch {devices} x {len(xs[0])}")
    start = time.perf_counter()
    losses = []
    for step in range(args.steps):
        first = (step * devices) % (len(xs) - devices + 1)
        x = np.concatenate(xs[first:first + devices])  # one bundled batch per device
        y = np.concatenate(ys[first:first + devices])
        losses.append(float(trainer.step(x, y)))
        say(f"step {step + 1} loss {losses[-1]:.4f}")
    say(f"{args.steps} steps in {time.perf_counter() - start:.1f} s (the first one compiles)")
    return 0 if all(np.isfinite(losses)) else 1


if __name__ == "__main__":
    sys.exit(main())
