"""Model-sized requests (#21): every size a model gives (attributes, declared shapes,
initializer dims, sparse ones too, shape inputs) is checked against the memory budget
(`load(..., max_bytes=...)`) before anything is allocated or traced, and refused with an
OnnxImportError naming the node. Each hostile model is a few hundred bytes; it must fail
cleanly, fast, and without a large allocation (peak RSS, measured in a child process), with
x64 on and off, called eagerly (one abstract dry run first) and under jit."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper

from jaxops.onnx import OnnxImportError, Program, load
from onnx_build import model, vi

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
BIG = 2 ** 40  # elements: terabytes whatever the dtype, above any machine's default budget


def _i64(*v):
    return np.array(v, np.int64)


def _sparse_model(dims, elem=FLOAT, np_type=np.float32):
    values = numpy_helper.from_array(np.ones(1, np_type), "s")
    values.data_type = elem
    indices = numpy_helper.from_array(_i64(0), "s_idx")
    sparse = helper.make_sparse_tensor(values, indices, dims)
    graph = helper.make_graph([helper.make_node("Identity", ["s"], ["y"])], "g", [],
                              [vi("y", elem)], sparse_initializer=[sparse])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _max_pool_grad(out_shape):
    """ORT's ONNX-domain MaxPoolGrad whose X shape comes only from its declared output."""
    node = helper.make_node("MaxPoolGrad", ["dy", "idx"], ["dx"], kernel_shape=[2, 2])
    return model([node], [], [vi("dx", FLOAT, out_shape)],
                 {"dy": np.ones((1, 1, 1, 1), np.float32), "idx": np.zeros((1, 1, 1, 1), np.int64)})


# name -> (model, load kwargs, inputs (None: load must fail), words the error holds)
CASES = {
    "onehot_host": (model([helper.make_node("OneHot", ["i", "d", "v"], ["y"])], [], ["y"],
                          {"i": _i64(0, 1), "d": np.int64(BIG), "v": _i64(0, 1)}),
                    {}, [], "OneHot"),
    "onehot_data": (model([helper.make_node("OneHot", ["i", "d", "v"], ["y"])],
                          [vi("i", INT64, [2])], ["y"],
                          {"d": np.int64(BIG), "v": np.array([0, 1], np.float32)}),
                    {}, [_i64(0, 1)], "OneHot"),
    "resize": (model([helper.make_node("Resize", ["x", "", "", "sizes"], ["y"])],
                     [vi("x", FLOAT, [1, 1, 4, 4])], ["y"],
                     {"sizes": _i64(1, 1, 2 ** 21, 2 ** 21)}, opset=13),
               {}, [np.ones((1, 1, 4, 4), np.float32)], "Resize"),
    "split_num_outputs": (model([helper.make_node("Split", ["x"], ["y"], num_outputs=BIG)],
                                [vi("x", FLOAT, [4])], ["y"], opset=18),
                          {}, [np.ones(4, np.float32)], "num_outputs"),
    "sparse_budget": (_sparse_model([2 ** 30]), {"max_bytes": 2 ** 30}, None, "sparse"),
    "sparse_default": (_sparse_model([BIG]), {}, None, "sparse"),
    # the 32 GiB complex sparse tensor under a 16 GiB budget (the default is half the
    # machine's memory: 64 GiB on the 128 GiB GPU machines, where it would load)
    "sparse_complex": (_sparse_model([2 ** 31], TensorProto.COMPLEX128, np.complex128),
                       {"max_bytes": 16 << 30}, None, "sparse"),
    # a budget above the address space: numpy's MemoryError must not leak
    "sparse_memory_error": (_sparse_model([2 ** 44], TensorProto.COMPLEX128, np.complex128),
                            {"max_bytes": 2 ** 62}, None, "sparse"),
    "max_pool_grad_budget": (_max_pool_grad([1, 1, 2 ** 15, 2 ** 15]), {"max_bytes": 2 ** 30},
                             [], "MaxPoolGrad"),
    "max_pool_grad_host": (_max_pool_grad([1, 1, 2 ** 20, 2 ** 20]), {"constants": ["dy"]},
                           [], "MaxPoolGrad"),
    "constant_of_shape": (model([helper.make_node("ConstantOfShape", ["s"], ["y"])], [], ["y"],
                                {"s": _i64(2 ** 20, 2 ** 20)}), {}, [], "ConstantOfShape"),
    # no check of its own: the dry run (eager) or the output check (jit) refuses it
    "expand_data": (model([helper.make_node("Expand", ["x", "s"], ["y"])], [vi("x", FLOAT, [1])],
                          ["y"], {"s": _i64(2 ** 20, 2 ** 20)}),
                    {}, [np.ones(1, np.float32)], "Expand"),
    "tile_host": (model([helper.make_node("Tile", ["c", "r"], ["y"])], [], ["y"],
                        {"c": _i64(1, 2), "r": _i64(BIG)}), {}, [], "Tile"),
    "range_host": (model([helper.make_node("Range", ["a", "b", "d"], ["y"])], [], ["y"],
                         {"a": np.int64(0), "b": np.int64(BIG), "d": np.int64(1)}),
                   {}, [], "Range"),
    "pad_host": (model([helper.make_node("Pad", ["c", "p"], ["y"])], [], ["y"],
                       {"c": _i64(1, 2), "p": _i64(0, BIG)}), {}, [], "Pad"),
    "topk_k": (model([helper.make_node("TopK", ["x", "k"], ["v", "i"])], [vi("x", FLOAT, [4])],
                     ["v", "i"], {"k": _i64(BIG)}), {}, [np.ones(4, np.float32)], "TopK"),
    "random_normal": (model([helper.make_node("RandomNormal", [], ["y"], shape=[2 ** 20, 2 ** 20])],
                            [], ["y"]), {}, [], "RandomNormal"),
    # two static ranges of 2**17 broadcast into 128 GiB: the host check before any node runs
    "host_outer_sum": (model([helper.make_node("Range", ["a", "b", "d"], ["r"]),
                              helper.make_node("Unsqueeze", ["r", "ax"], ["c"]),
                              helper.make_node("Add", ["r", "c"], ["y"])], [], ["y"],
                             {"a": np.int64(0), "b": np.int64(2 ** 17), "d": np.int64(1),
                              "ax": _i64(1)}), {}, [], "Add"),
}


def run_case(name, jit):
    """Loads and calls one case; returns the error text ('' when nothing was refused)."""
    import jax

    m, kwargs, inputs, _ = CASES[name]
    try:
        program = load(m.SerializeToString(), **kwargs)
        if inputs is None:
            return ""
        f = lambda *xs: program(program.params, *xs)  # noqa: E731
        (jax.jit(f) if jit else f)(*inputs)
    except OnnxImportError as e:
        return str(e) or "OnnxImportError"
    return ""


def _child(x64):
    """Runs every case in one child process; reports each error and the peak RSS growth."""
    code = f"""
import json, resource, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import jax
jax.config.update("jax_enable_x64", {x64})
import test_onnx_limits as t
t.run_case("constant_of_shape", False)  # warm up the imports
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {{}}
for name in t.CASES:
    for jit in (False, True):
        out[f"{{name}}/{{'jit' if jit else 'eager'}}"] = t.run_case(name, jit)
out["rss_growth_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"child died ({r.returncode}): {r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_hostile_sizes_refused_without_allocating(x64):
    out = _child(x64)
    # every case refused, naming the node's op, under 256 MiB of peak RSS for them all
    assert out.pop("rss_growth_kib") < 256 * 1024
    for key, error in out.items():
        words = CASES[key.split("/")[0]][3]
        assert error, f"{key}: loaded and ran"
        assert words in error, f"{key}: {error}"


def test_budget_names_node_and_default():
    from jaxops.onnx.program import default_max_bytes

    assert default_max_bytes() > 2 ** 30
    m = model([helper.make_node("ConstantOfShape", ["s"], ["y"], name="big")], [], ["y"],
              {"s": _i64(1024, 1024)})
    # 4 MiB: fine by default, refused under a 1 MiB budget, naming node and budget
    assert load(m)({}).shape == (1024, 1024)
    with pytest.raises(OnnxImportError, match=r"'big' \(ConstantOfShape\).*memory budget"):
        load(m, max_bytes=2 ** 20)({})
    # a Program built directly takes the same budget
    with pytest.raises(OnnxImportError, match="memory budget"):
        Program(m, max_bytes=2 ** 20)({})
    assert Program(m, max_bytes=2 ** 23).max_bytes == 2 ** 23


def test_sparse_initializers_count_together():
    sparse = []
    for k in range(3):  # three dense [2**18] float32: 1 MiB each
        values = numpy_helper.from_array(np.ones(1, np.float32), f"s{k}")
        sparse.append(helper.make_sparse_tensor(values, numpy_helper.from_array(_i64(0), "i"),
                                                [2 ** 18]))
    graph = helper.make_graph([helper.make_node("Sum", ["s0", "s1", "s2"], ["y"])], "g", [],
                              [vi("y")], sparse_initializer=sparse)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert load(m, max_bytes=2 ** 22)({}).shape == (2 ** 18,)
    with pytest.raises(OnnxImportError, match="sparse tensor 's2'"):
        load(m, max_bytes=2 ** 21 + 2 ** 20 - 1)


def test_eager_dry_run_runs_once_per_signature():
    m = model([helper.make_node("Expand", ["x", "s"], ["y"])], [vi("x", FLOAT, ["n"])], ["y"],
              {"s": _i64(2, 1)})
    program = load(m)
    for _ in range(3):
        assert program(program.params, np.ones(3, np.float32)).shape == (2, 3)
    program(program.params, np.ones(5, np.float32))
    assert len(program._dry_runs) == 2
