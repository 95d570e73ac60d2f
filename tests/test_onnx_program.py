"""The importer's core: load, params, calling under jit/grad/vmap, static shape arithmetic,
subgraphs, sequences, functions, com.microsoft through ORT_OPS, the inspect CLI."""
import io
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

pytest.importorskip("onnx")
from onnx import TensorProto, helper
from onnx_build import model, needs, vi

import jaxops
from jaxops.onnx import OnnxImportError, load, registry
from jaxops.onnx.__main__ import inspect

# A private domain with a few handlers, so the core is tested without the ai.onnx families.
T = "jaxops.test"
registry.handler("Mul", domain=T)(lambda ctx, a, b: a * b)
registry.handler("Sum", domain=T)(lambda ctx, x: jnp.sum(x))
registry.handler("ShapeOf", domain=T)(lambda ctx, x: np.array(np.shape(x), np.int64))
registry.handler("Fill", domain=T)(
    lambda ctx, shape, *, value=1.0: np.full([int(d) for d in ctx.static(shape, "shape")], value,
                                             np.float32))
registry.handler("Twice", domain=T)(lambda ctx, x: (x, 2 * x))
registry.handler("OpsetOf", domain=T)(lambda ctx: np.array(ctx.opset(""), np.int64))


def tnode(op, ins, outs, **kw):
    return helper.make_node(op, ins, outs, domain=T, **kw)


def tmodel(nodes, inputs, outputs, initializers=(), **kw):
    return model(nodes, inputs, outputs, initializers, domains=(T,), **kw)


W = np.arange(6, dtype=np.float32).reshape(2, 3) / 7


def scale_model():
    """y = x * w (w a float initializer: a param), s = sum(y), k an int initializer."""
    return tmodel([tnode("Mul", ["x", "w"], ["y"]), tnode("Sum", ["y"], ["s"])],
                  ["x"], ["y", "s"], {"w": W, "k": np.array([1, 2], np.int64)})


def test_load_path_bytes_proto_and_params(tmp_path):
    m = scale_model()
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    for source in (m, m.SerializeToString(), str(path), path):
        p = load(source)
        assert p.input_names == ["x"] and p.output_names == ["y", "s"]
        assert list(p.params) == ["w"]  # the int initializer stays static
        np.testing.assert_array_equal(p.params["w"], W)
        y, s = p(p.params, np.ones((2, 3), np.float32))
        np.testing.assert_allclose(y, W, rtol=1e-6)
        np.testing.assert_allclose(s, W.sum(), rtol=1e-6)


def test_keyword_inputs_and_call_errors():
    p = load(scale_model())
    x = np.full((2, 3), 2.0, np.float32)
    np.testing.assert_allclose(p(p.params, x=x)[1], 2 * W.sum(), rtol=1e-6)
    with pytest.raises(OnnxImportError, match="missing model input"):
        p(p.params)
    with pytest.raises(OnnxImportError, match="no input 'z'"):
        p(p.params, x, z=x)
    with pytest.raises(OnnxImportError, match="takes 1 inputs"):
        p(p.params, x, x)
    with pytest.raises(OnnxImportError, match="lacks initializer"):
        p({}, x)
    with pytest.raises(OnnxImportError, match="does not"):
        p({**p.params, "extra": W}, x)


def test_small_float_initializers_stay_static():
    """Float initializers go to the device at load, but small ones: a shape computed from one
    (Cast to int64, then Reshape's shape) resolves under jit when program.params are closed
    over, as Module's eval step and program.jit() do (as device arrays they were traced:
    Swin's ScatterND)."""
    nodes = [helper.make_node("Cast", ["s"], ["si"], to=TensorProto.INT64),
             helper.make_node("Add", ["x", "b"], ["xb"]),
             helper.make_node("Reshape", ["xb", "si"], ["y"])]
    m = model(nodes, [vi("x", TensorProto.FLOAT, [10, 12])],
              [vi("y", TensorProto.FLOAT, [8, 15])],
              initializers={"s": np.array([8.0, 15.0], np.float32),
                            "b": np.ones((10, 12), np.float32)})
    p = load(m)
    assert isinstance(p.params["s"], np.ndarray) and isinstance(p.params["b"], jax.Array)
    x = np.arange(120, dtype=np.float32).reshape(10, 12)
    assert jax.jit(lambda x: p(p.params, x))(x).shape == (8, 15)  # one output: the array
    np.testing.assert_array_equal(p.jit()(x), (x + 1).reshape(8, 15))


def test_params_on_the_device_and_the_jitted_forward():
    p = load(scale_model())
    assert isinstance(p.params["w"], np.ndarray)  # 6 elements: small, numpy (test above)
    x = np.full((2, 3), 2.0, np.float32)
    forward = p.jit()
    np.testing.assert_allclose(forward(x)[0], 2 * W, rtol=1e-6)
    np.testing.assert_allclose(forward(x=x)[1], 2 * W.sum(), rtol=1e-6)
    # the params are closed over: the jitted function's only argument is the input
    assert len(jax.tree_util.tree_leaves(forward.lower(x).args_info)) == 1
    # params of the user's: numpy, or a pytree they changed, through jit() and run()
    mine = {"w": 3 * W}
    np.testing.assert_allclose(p.jit(mine)(x)[0], 6 * W, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(p.run)(mine, x)[0], 6 * W, rtol=1e-6)
    changed = jax.tree_util.tree_map(lambda v: v + 1, p.params)
    np.testing.assert_allclose(p(changed, x)[0], 2 * (W + 1), rtol=1e-6)
    with pytest.raises(OnnxImportError, match="lacks initializer"):
        p.jit({})
    with pytest.raises(OnnxImportError, match="does not"):
        p.jit({"w": W, "extra": W})
    p.params = mine
    np.testing.assert_allclose(p.jit()(x)[0], 6 * W, rtol=1e-6)
    # loaded inside a trace, the params are still placed as arrays (no leaked tracer)
    loaded = []

    def load_and_run(x):
        loaded.append(load(scale_model()))
        return loaded[0](loaded[0].params, x)[0]
    np.testing.assert_allclose(jax.jit(load_and_run)(x), 2 * W, rtol=1e-6)
    assert not isinstance(loaded[0].params["w"], jax.core.Tracer)
    np.testing.assert_allclose(loaded[0](loaded[0].params, x)[0], 2 * W, rtol=1e-6)


def test_params_jax_would_narrow_stay_numpy():
    big = np.arange(120, dtype=np.float32).reshape(10, 12) / 7  # more than _HOST_SIZE
    m = tmodel([tnode("Mul", ["x", "w"], ["y"]), tnode("Mul", ["x", "v"], ["z"])], ["x"],
               ["y", "z"], {"w": big.astype(np.float64), "v": big})
    with jax.enable_x64(False):
        p = load(m)
        assert list(p.params) == ["w", "v"]
        assert isinstance(p.params["w"], np.ndarray) and p.params["w"].dtype == np.float64
        assert isinstance(p.params["v"], jax.Array) and p.params["v"].dtype == np.float32
        y, z = p.jit()(np.ones((10, 12), np.float32))
        np.testing.assert_allclose(y, big, rtol=1e-6)
        np.testing.assert_allclose(z, big, rtol=1e-6)
    p = load(m)  # with 64-bit types on, float64 is jax's own
    assert isinstance(p.params["w"], jax.Array) and p.params["w"].dtype == np.float64


def test_jit_grad_vmap():
    p = load(scale_model())
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    s = jax.jit(lambda params, x: p(params, x)[1])
    np.testing.assert_allclose(s(p.params, x), (x * W).sum(), rtol=1e-5)
    g = jax.jit(jax.grad(s, argnums=(0, 1)))(p.params, x)
    np.testing.assert_allclose(g[0]["w"], x, rtol=1e-6)
    np.testing.assert_allclose(g[1], W, rtol=1e-6)
    xs = np.stack([x, 2 * x])
    np.testing.assert_allclose(jax.vmap(s, in_axes=(None, 0))(p.params, xs),
                               [(x * W).sum(), 2 * (x * W).sum()], rtol=1e-5)
    params64 = {"w": W.astype(np.float64)}
    check_grads(lambda w, x: p({"w": w}, x)[1], (params64["w"], x.astype(np.float64)),
                order=2, modes=("fwd", "rev"))


def test_static_shape_arithmetic_under_jit():
    """ShapeOf gives numpy; Fill needs its shape statically: it resolves under jit."""
    m = tmodel([tnode("ShapeOf", ["x"], ["shp"]), tnode("Fill", ["shp"], ["ones"], value=3.0),
                tnode("Mul", ["x", "ones"], ["y"])], ["x"], ["y"])
    p = load(m)
    x = np.ones((2, 5), np.float32)
    np.testing.assert_allclose(jax.jit(p)(p.params, x), 3 * x)


def test_data_dependent_static_value_names_the_node():
    m = tmodel([tnode("Fill", ["shape"], ["y"], name="fill_1")], [vi("shape", TensorProto.INT64)],
               ["y"])
    p = load(m)
    assert p(p.params, np.array([2, 2])).shape == (2, 2)  # eager: concrete, fine
    with pytest.raises(OnnxImportError, match=r"'fill_1'.*shape must be known without the data"):
        jax.jit(p)(p.params, np.array([2, 2]))


def test_handler_outputs_and_opset():
    m = tmodel([tnode("Twice", ["x"], ["a", "b"]), tnode("OpsetOf", [], ["v"])],
               ["x"], ["a", "b", "v"], opset=13)
    p = load(m)
    a, b, v = p(p.params, np.ones(2, np.float32))
    np.testing.assert_allclose(b, 2 * a)
    assert int(v) == 13
    m = tmodel([tnode("Sum", ["x"], ["a", "b"], name="n")], ["x"], ["b"])
    with pytest.raises(OnnxImportError, match="'n'.*output 1"):
        load(m)(None, np.ones(2, np.float32))


def test_handler_failure_keeps_its_type_and_names_the_node():
    m = tmodel([tnode("Mul", ["x", "y"], ["z"], name="bad_mul")], ["x", "y"], ["z"])
    p = load(m)
    with pytest.raises(ValueError, match="broadcast") as e:
        p(p.params, np.ones(2), np.ones(3))
    assert not isinstance(e.value, OnnxImportError)
    assert e.value.__notes__ == ["(while running node 'bad_mul' (jaxops.test.Mul))"]
    # inside a subgraph: a note for each node the error passes through
    branch = helper.make_graph([tnode("Mul", ["x", "y"], ["z"], name="inner")], "b", [],
                               [vi("z")])
    m = tmodel([helper.make_node("If", ["c"], ["z"], name="outer", then_branch=branch,
                                 else_branch=branch)],
               ["x", "y", vi("c", TensorProto.BOOL)], ["z"])
    p = load(m)
    with pytest.raises(ValueError) as e:
        p(p.params, np.ones(2), np.ones(3), np.array(True))
    assert e.value.__notes__ == ["(while running node 'inner' (jaxops.test.Mul))",
                                 "(while running node 'outer' (If))"]


def test_unsupported_ops_listed_at_once():
    branch = helper.make_graph([helper.make_node("NoSuchOp3", [], ["o"])], "b", [], [vi("o")])
    nodes = [helper.make_node("NoSuchOp1", ["x"], ["a"]),
             helper.make_node("NoSuchOp2", ["a"], ["b"], domain="com.microsoft"),
             helper.make_node("If", ["c"], ["d"], then_branch=branch, else_branch=branch)]
    m = model(nodes, ["x", vi("c", TensorProto.BOOL)], ["b", "d"], domains=("com.microsoft",))
    with pytest.raises(OnnxImportError) as e:
        load(m)
    msg = str(e.value)
    assert "3 unsupported" in msg
    for part in ("('ai.onnx', 'NoSuchOp1', 17)", "('com.microsoft', 'NoSuchOp2', 1)",
                 "('ai.onnx', 'NoSuchOp3', 17)"):
        assert part in msg


@pytest.mark.parametrize("case", ["bytes", "dangling", "cycle", "twice", "output",
                                  "bad_tensor", "bad_attr", "no_graph"])
def test_malformed_models_raise_import_errors(case):
    nodes = [tnode("Mul", ["x", "x"], ["y"])]
    m = tmodel(nodes, ["x"], ["y"])
    if case == "bytes":
        source = b"\x08\x07garbage\xff\xff\xff"
    elif case == "dangling":
        m.graph.node[0].input[1] = "nowhere"
    elif case == "cycle":
        m.graph.node.extend([tnode("Mul", ["y", "z"], ["w"]), tnode("Mul", ["w", "x"], ["z"])])
    elif case == "twice":
        m.graph.node.extend([tnode("Mul", ["x", "x"], ["y"])])
    elif case == "output":
        m.graph.output[0].name = "absent"
    elif case == "bad_tensor":
        t = m.graph.initializer.add()
        t.name, t.data_type, t.raw_data = "w", TensorProto.FLOAT, b"\x00" * 3
        t.dims.append(4)
    elif case == "bad_attr":
        a = m.graph.node[0].attribute.add()
        a.name = "untyped"
    elif case == "no_graph":
        m.ClearField("graph")
    with pytest.raises(OnnxImportError):
        load(source if case == "bytes" else m)


def test_nodes_out_of_order_are_sorted():
    m = tmodel([tnode("Sum", ["y"], ["s"]), tnode("Mul", ["x", "x"], ["y"])], ["x"], ["s"])
    p = load(m)
    assert float(p(p.params, np.full(3, 2.0, np.float32))) == 12.0


def test_external_data_stays_in_the_model_folder(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "w.bin").write_bytes(W.tobytes())
    (tmp_path / "secret.bin").write_bytes(W.tobytes())
    (tmp_path / "models" / "link.bin").symlink_to(tmp_path / "secret.bin")

    def with_location(location):
        m = tmodel([tnode("Mul", ["x", "w"], ["y"])], ["x"], ["y"])
        t = m.graph.initializer.add()
        t.name, t.data_type = "w", TensorProto.FLOAT
        t.dims.extend(W.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", "0"), ("length", str(W.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        path = tmp_path / "models" / "m.onnx"
        path.write_bytes(m.SerializeToString())
        return path

    p = load(with_location("w.bin"))
    np.testing.assert_array_equal(p.params["w"], W)
    for bad in ("../secret.bin", str(tmp_path / "secret.bin"), "link.bin"):
        with pytest.raises(OnnxImportError, match="outside the model's folder"):
            load(with_location(bad))
    with pytest.raises(OnnxImportError, match="past the end"):
        m = with_location("w.bin")
        (tmp_path / "models" / "w.bin").write_bytes(b"\x00" * 4)
        load(m)


def _external_model(tmp_path, location):
    m = tmodel([tnode("Mul", ["x", "w"], ["y"])], ["x"], ["y"])
    t = m.graph.initializer.add()
    t.name, t.data_type = "w", TensorProto.FLOAT
    t.dims.extend(W.shape)
    t.data_location = TensorProto.EXTERNAL
    e = t.external_data.add()
    e.key, e.value = "location", location
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_external_data_reads_regular_files_only(tmp_path):
    """A FIFO inside the model's folder blocked load() forever (open waits for a writer); a
    folder or any other non-regular file is refused too."""
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "folder").mkdir()
    for location in ("pipe", "folder"):
        result = []

        def run():
            try:
                load(_external_model(tmp_path, location))
                result.append(None)
            except Exception as e:  # noqa: BLE001 - checked below
                result.append(e)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(30)
        if worker.is_alive():  # release the blocked open, then fail
            os.close(os.open(tmp_path / "pipe", os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail(f"load() hung on external data {location!r}")
        assert isinstance(result[0], OnnxImportError), result
        assert "not a regular file" in str(result[0]), result


def test_external_data_location_with_nul_byte(tmp_path):
    """os.path raised a bare ValueError ('embedded null byte')."""
    with pytest.raises(OnnxImportError, match="NUL byte"):
        load(_external_model(tmp_path, "w\0.bin"))


def test_python_op_needs_explicit_opt_in():
    node = helper.make_node("PythonOp", ["x"], ["ctx", "y"], domain="com.microsoft",
                            func_name="mymodule.Double")
    m = model([node], ["x"], ["y"], domains=("com.microsoft",))
    with pytest.raises(OnnxImportError, match="names Python code.*mymodule.Double"):
        load(m)
    m.graph.node.append(helper.make_node("NoSuchOp", ["y"], ["z"]))
    with pytest.raises(OnnxImportError, match="refused unless.*unsupported op.*NoSuchOp"):
        load(m)  # one error says both
    del m.graph.node[-1]
    p = load(m, python_ops={"mymodule.Double": lambda x, **attrs: (None, 2 * x)})
    np.testing.assert_allclose(p(p.params, np.ones(2, np.float32)), [2, 2])


def test_model_local_function_with_attribute_reference():
    body = [helper.make_node("Fill", ["shp"], ["f"], domain=T),
            helper.make_node("Mul", ["x", "f"], ["y"], domain=T)]
    body[0].attribute.append(helper.make_attribute_ref("value", helper.AttributeProto.FLOAT))
    f = helper.make_function("local", "ScaleBy", ["x", "shp"], ["y"], body,
                             [helper.make_opsetid("", 17), helper.make_opsetid(T, 1)],
                             attributes=["value"])
    call = helper.make_node("ScaleBy", ["x", "shp"], ["y"], domain="local", value=5.0)
    m = model([call], ["x", vi("shp", TensorProto.INT64)], ["y"], domains=(T, "local"),
              functions=[f])
    p = load(m)
    np.testing.assert_allclose(p(p.params, np.ones(3, np.float32), np.array([3])), [5, 5, 5])


def test_control_flow_if_static_and_traced():
    then = helper.make_graph([tnode("Mul", ["x", "two"], ["o"])], "then", [], [vi("o")],
                             [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    other = helper.make_graph([tnode("Mul", ["x", "x"], ["o"])], "else", [], [vi("o")])
    m = tmodel([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
               ["x", vi("c", TensorProto.BOOL, [])], ["y"])
    p = load(m)
    x = np.full(3, 3.0, np.float32)
    for fn in (p, jax.jit(p)):
        np.testing.assert_allclose(fn(p.params, x, np.array(True)), 2 * x)
        np.testing.assert_allclose(fn(p.params, x, np.array(False)), x * x)
    g = jax.grad(lambda x: jnp.sum(p(None, x, np.array(False))))(x)
    np.testing.assert_allclose(g, 2 * x)


def _loop_model(trips, cond_from_data=False):
    """carried v <- v * x for `trips` iterations; scan output: each v."""
    cond_out = (tnode("Mul", ["cond_in", "keep"], ["cond_out"]) if cond_from_data else
                helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    body = helper.make_graph(
        [tnode("Mul", ["v_in", "x"], ["v_out"]), tnode("Mul", ["v_out", "one"], ["scan"]),
         cond_out],
        "body", [vi("i", TensorProto.INT64, []), vi("cond_in", TensorProto.BOOL, []),
                 vi("v_in")], [vi("cond_out", TensorProto.BOOL), vi("v_out"), vi("scan")],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    return tmodel([helper.make_node("Loop", ["M", "", "v0"], ["v", "vs"], body=body)],
                  ["x", "v0"], ["v", "vs"], {"M": np.array(trips, np.int64)})


@needs("Identity")
@pytest.mark.parametrize("trips", [3, 100])
def test_control_flow_loop(trips):
    p = load(_loop_model(trips))
    x, v0 = np.full(2, 1.01, np.float32), np.ones(2, np.float32)
    for fn in (p, jax.jit(p)):
        v, vs = fn(p.params, x, v0)
        np.testing.assert_allclose(v, 1.01 ** trips * v0, rtol=1e-4)
        np.testing.assert_allclose(vs[:, 0], 1.01 ** np.arange(1, trips + 1), rtol=1e-4)
    g = jax.jit(jax.grad(lambda x: jnp.sum(p(None, x, v0)[0])))(x)
    np.testing.assert_allclose(g, trips * 1.01 ** (trips - 1), rtol=1e-4)


def test_control_flow_scan():
    body = helper.make_graph([tnode("Mul", ["s_in", "x"], ["s_out"]),
                              tnode("Mul", ["s_out", "s_out"], ["y"])], "body",
                             [vi("s_in"), vi("x")], [vi("s_out"), vi("y")])
    m = tmodel([helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1,
                                 scan_input_directions=[1])], ["s0", "xs"], ["s", "ys"])
    p = load(m)
    s0, xs = np.ones(2, np.float32), np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    s, ys = jax.jit(p)(p.params, s0, xs)
    np.testing.assert_allclose(s, xs.prod(0))
    # reversed input: the states are [5, 6], [15, 24], [15, 48], stored in iteration order
    np.testing.assert_allclose(ys, np.square([[5, 6], [15, 24], [15, 48]]))
    check_grads(lambda xs: p(None, s0.astype(np.float64), xs)[0], (xs.astype(np.float64),),
                order=1, modes=("rev",))


def test_sequences_as_graph_inputs_and_outputs():
    seq_t = helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)
    nodes = [helper.make_node("SequenceLength", ["seq"], ["n"]),
             helper.make_node("SequenceAt", ["seq", "n_minus"], ["last"]),
             helper.make_node("SequenceInsert", ["seq", "last"], ["longer"]),
             helper.make_node("ConcatFromSequence", ["longer"], ["cat"], axis=0, new_axis=1),
             tnode("Sum", ["cat"], ["total"])]
    m = tmodel(nodes, [seq_t], [vi("n", TensorProto.INT64), "cat", "total",
                                helper.make_tensor_sequence_value_info("longer", TensorProto.FLOAT,
                                                                None)],
               {"n_minus": np.array(-1, np.int64)})
    p = load(m)
    seq = [np.full(2, float(i), np.float32) for i in range(3)]
    n, cat, total, longer = jax.jit(p)(p.params, seq)
    assert int(n) == 3 and len(longer) == 4
    np.testing.assert_allclose(cat, [[0, 0], [1, 1], [2, 2], [2, 2]])
    g = jax.grad(lambda s: p(None, s)[2])(seq)
    np.testing.assert_allclose(g[2], [2, 2])  # the last element counts twice


def test_com_microsoft_through_ort_ops():
    node = helper.make_node("SoftmaxGrad_13", ["dY", "Y"], ["dX"], domain="com.microsoft", axis=1)
    m = model([node], ["dY", "Y"], ["dX"], domains=("com.microsoft",))
    p = load(m)
    rng = np.random.default_rng(1)
    dy = rng.normal(size=(2, 3)).astype(np.float32)
    y = jax.nn.softmax(rng.normal(size=(2, 3)).astype(np.float32), axis=1)
    want = jaxops.ops.softmax_grad_13(dy, y, axis=1)
    np.testing.assert_allclose(jax.jit(p)(p.params, dy, y), want, rtol=1e-6)


def test_schema_function_fallback():
    """An op with no handler but a function body in its ONNX schema runs expanded."""
    node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"], axes=[1])
    m = model([node], ["x"], ["y"], opset=18)
    try:
        p = load(m)  # the schema defines the op as a function of other ops
    except OnnxImportError as e:
        assert "unsupported op(s)" in str(e) and "ReduceMean" in str(e)  # the body's ops
        pytest.skip(f"its expansion needs ai.onnx handlers not here yet: {e}")
    x = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    y = p(p.params, x)
    want = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


def test_float_initializers_kept_static_on_request():
    m = tmodel([tnode("Fill", ["shape"], ["f"]), tnode("Mul", ["x", "f"], ["y"])], ["x"], ["y"],
               {"shape": np.array([2.0, 3.0], np.float32)})
    with pytest.raises(OnnxImportError, match="shape must be known"):
        p = load(m)
        jax.jit(p)(p.params, np.ones((2, 3), np.float32))
    p = load(m, constants=["shape"])
    assert p.params == {}
    np.testing.assert_allclose(jax.jit(p)(p.params, np.ones((2, 3), np.float32)), np.ones((2, 3)))


def test_inspect_cli(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(scale_model().SerializeToString())
    out = io.StringIO()
    assert inspect(str(path), out) == 0
    text = out.getvalue()
    assert "jaxops.test Mul v1  x1" in text and "params: 6 values" in text
    assert "x: FLOAT[...]" in text
    m = model([helper.make_node("NoSuchOp", ["x"], ["y"])], [vi("x", shape=[2, "n"])], ["y"])
    path.write_bytes(m.SerializeToString())
    proc = subprocess.run([sys.executable, "-m", "jaxops.onnx", "inspect", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "MISSING  ai.onnx NoSuchOp v17" in proc.stdout and "x: FLOAT[2, n]" in proc.stdout


def test_in_place_updates_of_ort_training_ops(monkeypatch):
    """InPlaceAccumulatorV2 names only its flag as output; run_with_updates gives the buffer."""
    key = ("com.microsoft", "InPlaceAccumulatorV2")
    if key not in jaxops.ops.ORT_OPS:  # the real op may not have landed: a stand-in, ORT's contract
        monkeypatch.setitem(jaxops.ops.ORT_OPS, key, lambda buffer, value, overwrite_flag=None: (
            np.array([True]),
            jnp.where(jnp.reshape(overwrite_flag, ()), value, buffer + value)
            if overwrite_flag is not None else buffer + value))
    node = helper.make_node("InPlaceAccumulatorV2", ["buf", "g", "reset"], ["flag"],
                            domain="com.microsoft")
    m = model([node], ["buf", "g", vi("reset", TensorProto.BOOL, [1])],
              [vi("flag", TensorProto.BOOL, [1])], domains=("com.microsoft",))
    p = load(m)
    buf, g = np.ones(3, np.float32), np.arange(3, dtype=np.float32)
    for reset, want in ((False, buf + g), (True, g)):
        outputs, updates = jax.jit(p.run_with_updates)(p.params, buf, g, np.array([reset]))
        assert bool(np.asarray(outputs[0]).all())
        np.testing.assert_allclose(updates["buf"], want)


def test_backend_api():
    from jaxops.onnx import backend

    assert backend.supports_device("CPU") and not backend.supports_device("TPU-X")
    rep = backend.prepare(scale_model())
    x = np.ones((2, 3), np.float32)
    y, s = rep.run({"x": x})
    assert isinstance(y, np.ndarray) and y.shape == (2, 3)
    np.testing.assert_allclose(rep.run([x])[1], W.sum(), rtol=1e-6)
    node = helper.make_node("SoftmaxGrad_13", ["dY", "Y"], ["dX"], domain="com.microsoft")
    dy, yv = np.ones((2, 3), np.float32), np.full((2, 3), 1 / 3, np.float32)
    (dx,) = backend.run_node(node, [dy, yv])
    np.testing.assert_allclose(dx, np.zeros((2, 3)), atol=1e-7)


@pytest.mark.parametrize("with_gradients", [True, False])
def test_lamb_node_leaves_out_new_gradients(with_gradients):
    """A LambOptimizer node that names no new_gradients output runs the kernel without them;
    its weights and moments are the same either way."""
    outs = ["step_out", "w_out", "g_out" if with_gradients else "", "m1_out", "m2_out"]
    node = helper.make_node("LambOptimizer", ["", "", "", "lr", "step", "w", "g", "m1", "m2"],
                            outs, domain="com.microsoft", alpha=[0.9], beta=[0.999],
                            epsilon=[1e-6], **{"lambda": [0.01]})
    named = [o for o in outs if o]
    m = model([node], [vi("lr", shape=[1]), vi("step", TensorProto.INT64, [1])]
              + [vi(x, shape=[4, 3]) for x in ("w", "g", "m1", "m2")], named,
              domains=("com.microsoft",))
    p = load(m)
    rng = np.random.default_rng(0)
    w, g, m1 = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(3))
    m2 = np.abs(rng.standard_normal((4, 3))).astype(np.float32)
    lr, step = np.array([0.1], np.float32), np.array([2], np.int64)
    got = dict(zip(named, jax.jit(p)(p.params, lr, step, w, g, m1, m2)))
    want = jaxops.ops.lamb_optimizer(None, None, None, lr[0], step, w, g, m1, m2, None,
                                     **{"lambda": [0.01]})
    for name, k in (("w_out", 1), ("m1_out", 3), ("m2_out", 4)):
        np.testing.assert_array_equal(got[name], want[k])
    if with_gradients:
        np.testing.assert_array_equal(got["g_out"], want[2])
    text = str(jax.make_jaxpr(lambda *a: p(p.params, *a))(lr, step, w, g, m1, m2))
    assert f"new_gradients={int(with_gradients)}" in text
