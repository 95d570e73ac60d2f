"""Fuzzing the importer with mutated models: load() may only raise OnnxImportError; running
what loads may also raise what a node's handler raises, which then names the node in a note.
No other exception, no crash, no hang.

The mutants run in a child process (so a crash or a hang is caught, not suffered) with a
time limit per model; running is tried only where every integer constant is small, so that a
mutant never legitimately asks for a huge loop or tensor.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

MUTANTS = 300
PER_MODEL_S = 20  # a load or a run longer than this is a hang
OPS = ["Add", "Mul", "MatMul", "Relu", "Reshape", "Shape", "Gather", "Concat", "Identity",
       "Transpose", "Softmax", "ReduceSum", "Cast", "If", "Loop", "Scan", "SequenceConstruct",
       "ConcatFromSequence", "SequenceAt", "Where", "Unknown"]


def seed_model() -> onnx.ModelProto:
    """A small graph touching static shape arithmetic, a subgraph, sequences, com.microsoft."""
    f = TensorProto.FLOAT
    branch = helper.make_graph([helper.make_node("Relu", ["h"], ["b"])], "branch", [],
                               [helper.make_tensor_value_info("b", f, None)])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "bias"], ["h"]),
        helper.make_node("Shape", ["h"], ["shp"]),
        helper.make_node("Gather", ["shp", "zero"], ["n"], axis=0),
        helper.make_node("Concat", ["n", "minus1"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["h", "newshape"], ["r"]),
        helper.make_node("If", ["flag"], ["br"], then_branch=branch, else_branch=branch),
        helper.make_node("Softmax", ["br"], ["y"], axis=-1),
        helper.make_node("SoftmaxGrad_13", ["r", "y"], ["dx"], domain="com.microsoft", axis=1),
        helper.make_node("SequenceConstruct", ["y", "dx"], ["seq"]),
        helper.make_node("ConcatFromSequence", ["seq"], ["cat"], axis=0),
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in {
        "w": np.ones((3, 4), np.float32), "bias": np.zeros(4, np.float32),
        "zero": np.array([0], np.int64), "minus1": np.array([-1], np.int64),
        "flag": np.array(True)}.items()]
    graph = helper.make_graph(
        nodes, "seed", [helper.make_tensor_value_info("x", f, [2, 3])],
        [helper.make_tensor_value_info("cat", f, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _all_graphs(g):
    yield g
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_graphs(a.g)


def mutate(m: onnx.ModelProto, rng: random.Random) -> bytes:
    m = onnx.ModelProto.FromString(m.SerializeToString())
    for _ in range(rng.randint(1, 3)):
        graphs = list(_all_graphs(m.graph))
        g = rng.choice(graphs)
        kind = rng.randrange(12)
        names = [o for n in g.node for o in n.output] + [i.name for i in g.input] + ["ghost"]
        if kind == 0 and g.node:
            rng.choice(g.node).op_type = rng.choice(OPS)
        elif kind == 1 and g.node:
            n = rng.choice(g.node)
            if n.input:
                n.input[rng.randrange(len(n.input))] = rng.choice(names)
        elif kind == 2 and g.node:
            n = rng.choice(g.node)
            if n.input:
                del n.input[rng.randrange(len(n.input))]
        elif kind == 3 and len(g.node) > 1:
            nodes = list(g.node)
            rng.shuffle(nodes)
            del g.node[:]
            g.node.extend(nodes)
        elif kind == 4 and g.node:
            n = rng.choice(g.node)
            a = n.attribute.add()
            a.name = rng.choice(["axis", "body", "then_branch", "perm", "to", "alpha"])
            a.type = rng.choice(list(onnx.AttributeProto.AttributeType.values()))
            a.i = rng.choice([-(2 ** 40), -3, 0, 7, 2 ** 40])
        elif kind == 5 and g.initializer:
            t = rng.choice(g.initializer)
            t.data_type = rng.randrange(0, 27)
        elif kind == 6 and g.initializer:
            t = rng.choice(g.initializer)
            t.dims.append(rng.choice([0, 2, 5]))
        elif kind == 7:
            m.opset_import[0].version = rng.randint(0, 30)
        elif kind == 8 and g.node:
            g.node.append(rng.choice(g.node))  # a value produced twice
        elif kind == 9 and g.output:
            g.output[0].name = rng.choice(names)
        elif kind == 10 and g.node:
            n = rng.choice(g.node)
            if n.output:
                n.output[0] = rng.choice(names)  # may close a cycle
        else:
            n = rng.choice(g.node) if g.node else None
            if n is not None and n.attribute:
                del n.attribute[rng.randrange(len(n.attribute))]
    data = bytearray(m.SerializeToString())
    if rng.random() < 0.3:  # byte-level damage too
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    if rng.random() < 0.1:
        data = data[:rng.randrange(len(data))]
    return bytes(data)


def _small_ints(m: onnx.ModelProto) -> bool:
    for g in _all_graphs(m.graph):
        for t in g.initializer:
            try:
                v = numpy_helper.to_array(t)
            except Exception:  # noqa: BLE001
                return False
            if v.dtype.kind in "iu" and v.size and np.abs(v).max() > 64 or v.size > 4096:
                return False
    return True


def _inputs(program, m):
    out = []
    types = {vi.name: vi.type for vi in m.graph.input}
    for name in program.input_names:
        tt = types[name].tensor_type
        shape = [d.dim_value if d.dim_value > 0 else 2 for d in tt.shape.dim][:4]
        try:
            dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        except Exception:  # noqa: BLE001
            dtype = np.float32
        out.append(np.ones(shape, dtype))
    return out


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def worker(seed: int, count: int) -> dict:
    import jax  # noqa: PLC0415 - the child process only

    jax.config.update("jax_enable_x64", True)
    from jaxops.onnx import OnnxImportError, load  # noqa: PLC0415

    rng = random.Random(seed)
    base = seed_model()
    report = {"loaded": 0, "ran": 0, "rejected": 0, "bad": []}
    signal.signal(signal.SIGALRM, _alarm)
    for i in range(count):
        data = mutate(base, rng)
        stage = "load"
        signal.alarm(PER_MODEL_S)
        try:
            program = load(data)
            report["loaded"] += 1
            m = program.model
            if _small_ints(m):
                stage = "run"
                program(program.params, *_inputs(program, m))
                report["ran"] += 1
        except OnnxImportError:
            report["rejected"] += 1
        except _Hang:
            report["bad"].append(f"mutant {i}: {stage} took over {PER_MODEL_S} s")
        except Exception as e:  # noqa: BLE001 - what the test looks for
            if stage == "run" and any("while running node" in n
                                      for n in getattr(e, "__notes__", ())):
                report["rejected"] += 1  # a node's own error, naming the node
            else:
                report["bad"].append(f"mutant {i}: {stage}: {type(e).__name__}: {e}"[:400])
        finally:
            signal.alarm(0)
    return report


def test_mutated_models_raise_only_import_errors():
    seed = int(os.environ.get("JAXOPS_FUZZ_SEED", time.time_ns() % 100000))
    print(f"fuzz seed={seed}")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__, str(seed), str(MUTANTS)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (f"the fuzz child died (rc {proc.returncode}):\n"
                                  f"{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(report)
    assert not report["bad"], "\n".join(report["bad"])
    assert report["loaded"] + report["rejected"] >= MUTANTS  # every mutant was tried


if __name__ == "__main__":
    print(json.dumps(worker(int(sys.argv[1]), int(sys.argv[2]))))
