"""GatherGrad's CUDA kernels one by one, for Nsight Compute: the bench shapes, two calls each.

  ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \\
      --log-file ncu.csv python3 tools/gather_phases.py
  python3 tools/gather_phases.py --parse ncu.csv     (a table: kernel, µs, per shape)
"""
import csv
import sys

SHAPES = [("bf16", 50304, 1024, 16384, 1.2), ("bf16", 1024, 1024, 65536, None),
          ("f32", 1024, 1024, 65536, None), ("f32", 50304, 1024, 16384, 1.2)]


def run():
    import jax
    import jax.numpy as jnp

    from bench.gather import _ids
    from bench.harness import DTYPES
    from jaxops import ops
    for dt, v, d, n, zipf in SHAPES:
        k1, k2 = jax.random.split(jax.random.key(0))
        ids = _ids(k1, n, v, zipf)
        dy = jax.random.normal(k2, (n, d), jnp.float32).astype(DTYPES[dt])
        f = jax.jit(lambda i, g, v=v, d=d: ops.gather_grad((v, d), i, g))
        jax.block_until_ready(f(ids, dy))  # compile, and a marker call
        for _ in range(2):
            jax.block_until_ready(f(ids, dy))


def parse(path):
    rows = []
    with open(path) as fh:
        lines = [ln for ln in fh if ln.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            unit = r.get("Metric Unit", "ns")
            val = float(r["Metric Value"].replace(",", ""))
            us = val * {"n": 1e-3, "u": 1.0, "m": 1e3}.get(unit[:1], 1e-3)
            rows.append((r["Kernel Name"][:60], us))
    for name, us in rows:
        print(f"{us:9.1f}  {name}")


if __name__ == "__main__":
    parse(sys.argv[2]) if sys.argv[1:2] == ["--parse"] else run()
