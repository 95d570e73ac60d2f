"""All-reduce of a GPT-2-small gradient list (124M float params, 148 tensors) over the local
devices: jaxops.ops.nccl_all_reduce (ORT's NcclAllReduce: every tensor in one fused
collective) against a plain `lax.psum` of each tensor and a psum of one concatenated buffer,
and a floor: the same call with no collective (one elementwise pass over each buffer), which
shows how much of a call is dispatch of its 2 x 148 buffers a device.

    python -m bench.allreduce_2gpu                   # all local devices (2 GPUs: the target)
    python -m bench.allreduce_2gpu --dtype bf16 --reps 50
    python -m bench.allreduce_2gpu --torch           # and PyTorch's NCCL on the same list
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m bench.allreduce_2gpu --quick

Reported per variant: the number of all-reduce ops in the compiled HLO (XLA's combiner may
merge the per-tensor psums too), the median time of one call (after warm-up, each call
synced), algorithm bandwidth (gradient bytes / time) and bus bandwidth (algbw * 2(n-1)/n,
NCCL's convention: the bytes each link carries in a ring all-reduce). Every variant's result
is checked against the sum of the per-device gradients first. --quick shrinks the model
(vocab 1000, width 64, 2 layers) so it runs on forced CPU devices in seconds.

Not a `python -m bench` family: a multi-device collective does not fit that harness's
single-device cases (sharded inputs, bus bandwidth), so `cases()` below is empty and this
module runs standalone.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import ops

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def gpt2_shapes(vocab=50257, context=1024, width=768, layers=12):
    """GPT-2's trainable tensors (HF layout; the LM head shares wte): 124,439,808 params at
    the defaults."""
    shapes = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,),                         # ln_1
                   (width, 3 * width), (3 * width,),           # attn.c_attn
                   (width, width), (width,),                   # attn.c_proj
                   (width,), (width,),                         # ln_2
                   (width, 4 * width), (4 * width,),           # mlp.c_fc
                   (4 * width, width), (width,)]               # mlp.c_proj
    return shapes + [(width,), (width,)]                       # ln_f


def _variants(axis):
    def packed(*grads):
        out = ops.nccl_all_reduce(*grads, axis_name=axis)
        return out if isinstance(out, tuple) else (out,)

    def per_tensor(*grads):
        return tuple(lax.psum(g, axis) for g in grads)

    def concatenated(*grads):
        flat = lax.psum(jnp.concatenate([g.ravel() for g in grads]), axis)
        ends = np.cumsum([g.size for g in grads])
        return tuple(flat[e - g.size:e].reshape(g.shape) for g, e in zip(grads, ends))

    def no_collective(*grads):  # the floor: the same call with one pass over each buffer
        return tuple(g + 1 for g in grads)

    return {"nccl_all_reduce": packed, "psum_per_tensor": per_tensor,
            "psum_concat": concatenated, "no_collective": no_collective}


def _all_reduces(compiled) -> int:
    return len(re.findall(r"\ball-reduce(?:-start)?\(", compiled.as_text()))


def run(quick=False, dtype="f32", reps=20, warmup=3, devices=None):
    devs = jax.devices()[:devices] if devices else jax.devices()
    n = len(devs)
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))
    shapes = gpt2_shapes(1000, 128, 64, 2) if quick else gpt2_shapes()
    jdt = DTYPES[dtype]
    params = sum(int(np.prod(s)) for s in shapes)
    nbytes = params * jnp.dtype(jdt).itemsize
    spec = NamedSharding(mesh, P("data"))

    # device d's gradients: row d of a stacked [n, *shape] array sharded over "data"
    rng = np.random.default_rng(0)
    grads = [jax.device_put(rng.standard_normal((n, *s), np.float32).astype(jdt), spec)
             for s in shapes]
    # checked on the last 4 tensors (small ones: host copies only, no extra compilation)
    check = [np.asarray(g).astype(np.float64).sum(0) for g in grads[-4:]]
    rows = []
    for name, fn in _variants("data").items():
        body = lambda *g, fn=fn: tuple(o[None] for o in fn(*[x[0] for x in g]))
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * len(shapes),
                                  out_specs=(P("data"),) * len(shapes)))
        compiled = f.lower(*grads).compile()
        out = compiled(*grads)
        tol = 1e-4 if dtype == "f32" else 5e-2
        for got, want in zip(out[-4:], check if name != "no_collective" else []):
            for d in range(n):  # every device holds the sum
                np.testing.assert_allclose(np.asarray(got)[d].astype(np.float64), want,
                                           rtol=tol, atol=tol * n, err_msg=name)
        for _ in range(warmup):
            jax.block_until_ready(compiled(*grads))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*grads))
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        algbw = nbytes / t / 1e9
        rows.append({"variant": name, "all_reduce_ops": _all_reduces(compiled),
                     "time_ms": t * 1e3, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * 2 * (n - 1) / n})
        del out
    return {"devices": n, "platform": devs[0].platform, "device_kind": devs[0].device_kind,
            "dtype": dtype, "tensors": len(shapes), "params": params, "bytes": nbytes,
            "quick": quick, "rows": rows}


def _torch_worker(rank, n, numel, shapes, dtype, reps, warmup, port, results):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    flat = torch.randn(numel, device="cuda").to(tdt)
    parts = list(torch.split(flat, [int(np.prod(s)) for s in shapes]))
    variants = {"torch_one_buffer": lambda: dist.all_reduce(flat),
                "torch_per_tensor": lambda: [dist.all_reduce(t) for t in parts]}
    for name, fn in variants.items():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        if rank == 0:
            results.put((name, statistics.median(times)))
    dist.destroy_process_group()


def torch_rows(shapes, dtype, reps, n, warmup=3):
    """PyTorch's NCCL on the same list, one process a GPU: one flat buffer (as ORT packs its
    NcclAllReduce inputs) and one all_reduce per tensor; the same row fields as run()."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    numel = sum(int(np.prod(s)) for s in shapes)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_torch_worker, args=(n, numel, shapes, dtype, reps, warmup, port, results),
                       nprocs=n, start_method="spawn")
    nbytes = numel * {"f32": 4, "bf16": 2, "f16": 2}[dtype]
    rows = []
    while not results.empty():
        name, t = results.get()
        algbw = nbytes / t / 1e9
        rows.append({"variant": name, "all_reduce_ops": 1 if "one" in name else len(shapes),
                     "time_ms": t * 1e3, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * 2 * (n - 1) / n})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.allreduce_2gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small model (CPU, seconds)")
    p.add_argument("--dtype", choices=list(DTYPES), default="f32")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--devices", type=int, help="use the first N devices (default: all)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--torch", action="store_true",
                   help="also time PyTorch's NCCL on the same list (GPUs; one process each)")
    args = p.parse_args(argv)
    if len(jax.devices()[:args.devices] if args.devices else jax.devices()) < 2:
        sys.exit("needs at least 2 devices (on CPU: "
                 "XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    peers = []
    if args.torch:  # before jax takes the GPUs
        shapes = gpt2_shapes(1000, 128, 64, 2) if args.quick else gpt2_shapes()
        peers = torch_rows(shapes, args.dtype, args.reps, args.devices or len(jax.devices()))
    r = run(args.quick, args.dtype, args.reps, devices=args.devices)
    r["rows"] += peers
    print(f"all-reduce of {r['tensors']} tensors, {r['params']:,} params {r['dtype']} "
          f"({r['bytes'] / 2**20:.1f} MiB) over {r['devices']} {r['device_kind']} device(s)")
    print(f"{'variant':<18}{'all-reduces':>12}{'time ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for row in r["rows"]:
        print(f"{row['variant']:<18}{row['all_reduce_ops']:>12}{row['time_ms']:>10.3f}"
              f"{row['algbw_GBps']:>12.2f}{row['busbw_GBps']:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


def cases(quick):
    """No harness cases: see the module docstring."""
    return []


if __name__ == "__main__":
    sys.exit(main())
