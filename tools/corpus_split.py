"""Where a corpus forward's time goes, jaxops against ONNX Runtime, segment by segment.

    taskset -c 1 python tools/corpus_split.py mobilenetv3_ts [--cuts a,b,...] [--reps N]

The model (forward.onnx, or eval_model.onnx with the checkpoint's parameters made
initializers and the loss left out) is cut into segments at the given value names (default:
the last output of each top-level block, found from the node names) and each segment runs
alone: jaxops as `load(segment).jit()` (weights closed over), ORT as an InferenceSession with
one thread. Each side is reported minus its own floor, a call of a trivial program on the
same input: ORT's a ReduceSum session, jaxops' a jitted sum of at least 1000 flops (XLA:CPU
runs a program under 1000 flops, by its cost analysis, inline on the calling thread and any
other on a worker thread: pinned to one core that hand-off costs ~15 us, and every segment
is above it). The calls are interleaved, medians of --reps; the process binds itself to the
lowest core it may use. A segment's input and output are NCHW, so jaxops' channels-last
convolutions pay a transpose at each cut that the whole model does not.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "corpus"


def _model(name):
    import numpy as np
    import onnx
    from onnx import numpy_helper
    d = CORPUS / name
    if (d / "forward.onnx").exists():
        return onnx.load(str(d / "forward.onnx"))
    from jaxops.onnx.training import CheckpointState
    model = onnx.load(str(d / "eval_model.onnx"))
    state = CheckpointState.load_checkpoint(d / "checkpoint").train_state
    params = {k: np.asarray(v) for k, v in {**state.params, **state.frozen}.items()}
    keep = [i for i in model.graph.input if i.name not in params]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in params.items())
    return model


def _default_cuts(model):
    """The last output of each top-level block (/inner/<part>/<block>/...) up to the last
    one with a convolution, then the logits (the head as one segment)."""
    last, has_conv = {}, {}
    for node in model.graph.node:
        parts = node.name.split("/")
        if len(parts) > 3 and node.op_type != "Constant":
            key = tuple(parts[1:4])
            last[key] = node.output[0]
            has_conv[key] = has_conv.get(key, False) or node.op_type == "Conv"
    keys = list(last)
    conv_keys = [i for i, k in enumerate(keys) if has_conv[k]]
    keys = keys[:conv_keys[-1] + 1] if conv_keys else keys
    logits = [n.output[0] for n in model.graph.node if n.op_type == "Gemm"][-1:]
    return list(dict.fromkeys([*(last[k] for k in keys), *logits]))


def _segments(model, cuts, folder):
    import onnx
    full = Path(folder) / "full.onnx"
    onnx.save(model, str(full))
    names = [model.graph.input[0].name, *cuts]
    for i, (a, b) in enumerate(zip(names, names[1:])):
        path = Path(folder) / f"segment{i}.onnx"
        onnx.utils.extract_model(str(full), str(path), [a], [b], check_model=False)
        yield a, b, onnx.load(str(path))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a corpus export (tests/data/corpus/NAME)")
    p.add_argument("--cuts", help="comma list of value names to cut after")
    p.add_argument("--reps", type=int, default=500)
    args = p.parse_args(argv)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before jax and ORT start threads
    import jax
    import jax.numpy as jnp
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from jaxops.onnx import load
    model = onnx.shape_inference.infer_shapes(_model(args.model))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    cuts = args.cuts.split(",") if args.cuts else _default_cuts(model)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for a, b, seg in _segments(model, cuts, folder):
            x = rng.standard_normal(shapes[a]).astype(np.float32)
            ours = load(seg).jit()
            theirs = ort.InferenceSession(seg.SerializeToString(), opts,
                                          providers=["CPUExecutionProvider"])
            graph = helper.make_graph(
                [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "floor",
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, shapes[a])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
            floor_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
            floor_model.ir_version = 9
            ort_floor = ort.InferenceSession(floor_model.SerializeToString(), opts,
                                             providers=["CPUExecutionProvider"])
            tiles = max(2, -(-1000 // x.size) + 1)  # >= 1000 flops: run as the segments are
            jax_floor = jax.jit(lambda v, t=tiles: jnp.tile(v.reshape(-1), t).sum())
            name = theirs.get_inputs()[0].name
            diff = float(np.abs(np.asarray(ours(x)) - theirs.run(None, {name: x})[0]).max())
            ops = collections.Counter(n.op_type for n in seg.graph.node if n.op_type != "Constant")
            rows.append({
                "segment": f"{a.split('/')[-2] if '/' in a else a} -> "
                           f"{b.split('/')[-2] if '/' in b else b}",
                "ops": dict(ops), "max_abs_diff": diff,
                "fns": [lambda f=ours, x=x: jax.block_until_ready(f(x)),
                        lambda f=jax_floor, x=x: jax.block_until_ready(f(x)),
                        lambda s=theirs, x=x, n=name: s.run(None, {n: x}),
                        lambda s=ort_floor, x=x: s.run(None, {"x": x})]})
    times = [[[] for _ in range(4)] for _ in rows]
    for _ in range(args.reps):
        for row, t in zip(rows, times):
            for i, fn in enumerate(row["fns"]):
                fn()
                t0 = time.perf_counter()
                fn()
                t[i].append(time.perf_counter() - t0)
    print(f"{'segment':<40} {'jaxops':>7} {'ORT':>7} {'gap':>6}   us over each floor "
          f"(floors: jaxops / ORT), ops")
    total = [0.0, 0.0]
    for row, t in zip(rows, times):
        m = [1e6 * statistics.median(v) for v in t]
        ours, theirs = m[0] - m[1], m[2] - m[3]
        total = [total[0] + ours, total[1] + theirs]
        print(f"{row['segment'][:40]:<40} {ours:7.1f} {theirs:7.1f} {ours - theirs:6.1f}   "
              f"({m[1]:.1f} / {m[3]:.1f}) {json.dumps(row['ops'])} diff {row['max_abs_diff']:.1e}")
    print(f"{'sum':<40} {total[0]:7.1f} {total[1]:7.1f} {total[0] - total[1]:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
