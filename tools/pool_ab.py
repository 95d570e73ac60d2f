"""MaxPool/AveragePool's sliced form (handlers/pool.py's _sliced) against the gather form, on
corpus forwards (`program.jit()`), the two compiled side by side and called alternately:

    taskset -c 1 python tools/pool_ab.py [deeplabv3_ts,deeplabv3_dynamo] [reps]

prints each model's median call time per form (µs) and their ratio, on the CPU (other
platforms run the gather either way)."""
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


def main(names="deeplabv3_ts,deeplabv3_dynamo", reps="1000"):
    for name in names.split(","):
        (fg, x, yg), (fs, _, ys) = _forward(name, 0), _forward(name, 64)
        print(f"{name}: max |sliced - gathered| {float(np.abs(ys - yg).max()):.2e}")
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
