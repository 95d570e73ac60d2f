"""Send/Recv (jaxops.ops.send, recv, send_recv) against numpy on 4 forced CPU devices or, under
JAX_PLATFORMS=cuda, on every GPU of the machine (ranks are taken modulo the world), and the
importer's pairing of Send/Recv nodes in an SPMD graph (a 2-stage pipeline)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from helpers import on_cpu_devices, world
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads
from onnx import TensorProto, helper

import jaxops.onnx
from jaxops import ops
from jaxops.onnx import OnnxImportError

W = world(4)  # ranks of the default mesh


def _mesh(n=W, name="pipe"):
    if n < 2:
        pytest.skip("Send/Recv needs 2 devices")
    return jax.sharding.Mesh(np.array(on_cpu_devices(n)), (name,))


def _per_rank(fn, mesh, *stacked, replicated=()):
    """fn on every rank; stacked[i][r] is rank r's operand i (operands whose index is in
    `replicated` are the same on every rank and passed whole). Outputs stacked by rank."""
    axis = mesh.axis_names[0]
    specs = tuple(P() if i in replicated else P(axis) for i in range(len(stacked)))
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(stacked, specs)]

    def body(*xs):
        xs = [x if i in replicated else x[0] for i, x in enumerate(xs)]
        return jax.tree.map(lambda y: y[None], fn(*xs))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(axis)))(*placed)


def _expected(x, source, destination):
    want = np.zeros_like(x)
    want[destination] = x[source]
    return want


DTYPES = [np.float32, np.float64, np.float16, jnp.bfloat16, np.int32, np.int8, np.uint16,
          np.bool_]


@pytest.mark.parametrize("source,destination", [(0, 1), (W - 1, 0), (1, 2 % W)])
def test_send_recv_delivers_every_dtype(rng, source, destination):
    mesh = _mesh()
    # An empty tensor only on the CPU: on GPUs, XLA's compiler (jaxlib 0.11.2) segfaults on any
    # jit(shard_map) with an empty sharded operand beside another, even an identity body
    # without jaxops (seen on 2 and 4 H200s).
    empty = (0, 2) if jax.default_backend() == "cpu" else (1, 2)
    shapes = [(3, 5), (7,), (), (2, 1, 3), (4,), empty, (5,), (3, 3)]
    data = []
    for dtype, shape in zip(DTYPES, shapes):
        x = rng.standard_normal((W, *shape)) * 50
        data.append((x > 0) if dtype == np.bool_ else x.astype(dtype))
    out = _per_rank(lambda *d: ops.send_recv(True, source, destination, *d), mesh, *data)
    signal, received = out[0], out[1:]
    np.testing.assert_array_equal(signal, np.ones(W, bool))
    for x, got in zip(data, received):
        assert got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_array_equal(np.asarray(got), _expected(np.asarray(x), source,
                                                                 destination))


def test_send_handle_and_recv_pair(rng):
    mesh = _mesh()
    x = rng.standard_normal((W, 6)).astype(np.float32)
    n = np.arange(W * 2, dtype=np.int32).reshape(W, 2)

    def body(x, n):
        pending = ops.send(np.array(True), 2 % W, x, n, tag=7, element_types=[1, 6])
        assert isinstance(pending, ops.Send) and pending.destination == 2 % W
        return ops.recv(np.array([True]), np.int64(1), tag=7, element_types=[1, 6],
                        send=pending)

    signal, rx, rn = _per_rank(body, mesh, x, n)
    assert signal.shape == (W,) and signal.all()
    np.testing.assert_array_equal(rx, _expected(x, 1, 2 % W))
    np.testing.assert_array_equal(rn, _expected(n, 1, 2 % W))


def test_one_collective_permute_for_all_tensors(rng):
    mesh = _mesh()
    data = [rng.standard_normal((W, 3)).astype(np.float32), np.ones((W, 5), np.int32),
            rng.standard_normal((W, 2))]
    spec = P("pipe")
    f = jax.jit(jax.shard_map(lambda *d: ops.send_recv(True, 0, W - 1, *d)[1:], mesh=mesh,
                              in_specs=(spec,) * 3, out_specs=(spec,) * 3))
    hlo = f.lower(*[jax.device_put(x, NamedSharding(mesh, spec)) for x in data]).compile().as_text()
    permutes = [ln for ln in hlo.splitlines() if re.search(r"collective-permute(-start)?\(", ln)]
    assert len(permutes) == 1, permutes
    assert f"source_target_pairs={{{{0,{W - 1}}}}}" in permutes[0]
    assert not re.search(r"all-gather|all-reduce|all-to-all", hlo)


def test_gradient_goes_back_to_the_source(rng):
    mesh = _mesh()
    x = rng.standard_normal((W, 5))
    n = np.arange(W * 3).reshape(W, 3)  # an integer tensor alongside: no gradient
    w = rng.standard_normal((W, 5))

    def loss(x):
        out = _per_rank(lambda x, n, w: jnp.sum(ops.send_recv(True, 2 % W, 1, x, n)[1] * w),
                        mesh, x, n, w)
        return out.sum()

    g = jax.grad(loss)(x)
    np.testing.assert_allclose(g, _expected(w, 1, 2 % W), rtol=1e-12)
    f = lambda x, y: _per_rank(lambda a, b: ops.send_recv(True, 0, W - 1, a, b)[1:], mesh, x, y)
    check_grads(f, (x, rng.standard_normal((W, 2, 2)).astype(np.float64)), order=2,
                modes=["rev"])


def test_gradient_of_a_replicated_operand(rng):
    """A value the same on every rank (not sharded): its gradient sums over the ranks, i.e.
    is the cotangent that reached the destination."""
    mesh = _mesh()
    x = rng.standard_normal(5)
    w = rng.standard_normal((W, 5))

    def loss(x):
        return _per_rank(lambda x, w: jnp.sum(ops.send_recv(True, 0, W - 1, x)[1] * w), mesh, x, w,
                         replicated=(0,)).sum()

    np.testing.assert_allclose(jax.grad(loss)(x), w[W - 1], rtol=1e-12)


def test_vmap_inside_shard_map(rng):
    mesh = _mesh()
    x = rng.standard_normal((W, 3, 2)).astype(np.float32)
    y = rng.standard_normal((W, 2)).astype(np.float32)
    out = _per_rank(jax.vmap(lambda a, b: ops.send_recv(True, 1, 0, a, b)[1:], in_axes=(0, None)),
                    mesh, x, y)
    np.testing.assert_array_equal(out[0], _expected(x, 1, 0))
    np.testing.assert_array_equal(out[1], np.broadcast_to(_expected(y, 1, 0)[:, None],
                                                          (W, 3, 2)))
    # vmap(grad): per example, the gradient comes back from the destination to the source
    w = rng.standard_normal((W, 3, 2)).astype(np.float32)
    grad = jax.vmap(jax.grad(lambda a, w: jnp.sum(ops.send_recv(True, 1, 0, a)[1] * w)))
    g = _per_rank(grad, mesh, x, w)
    np.testing.assert_allclose(g, _expected(w, 0, 1), rtol=1e-6)


def test_pipeline_axis_is_overridable(rng):
    mesh = _mesh(name="stage")
    x = rng.standard_normal((W, 3))
    with pytest.raises(ValueError, match="'pipe' is not bound"):
        _per_rank(lambda v: ops.send_recv(True, 0, 1, v), mesh, x)
    with ops.pipeline_axis("stage"):
        out = _per_rank(lambda v: ops.send_recv(True, 0, 1, v)[1], mesh, x)
    np.testing.assert_array_equal(out, _expected(x, 0, 1))
    out = _per_rank(lambda v: ops.send_recv(True, W - 1, W - 2, v, axis_name="stage")[1], mesh, x)
    np.testing.assert_array_equal(out, _expected(x, W - 1, W - 2))


def test_bad_input(rng):
    mesh = _mesh()
    x = rng.standard_normal((W, 3)).astype(np.float32)
    run = lambda fn: _per_rank(fn, mesh, x)
    with pytest.raises(ValueError, match=f"rank {W - 1} sends to itself"):
        run(lambda v: ops.send_recv(True, W - 1, W - 1, v))
    with pytest.raises(ValueError, match=f"destination rank {W} is outside the {W} ranks"):
        run(lambda v: ops.send_recv(True, 0, W, v))
    with pytest.raises(ValueError, match="source rank -1 is outside"):
        run(lambda v: ops.send_recv(True, -1, 1, v))
    with pytest.raises(ValueError, match="must be known while tracing"):
        run(lambda v: ops.send_recv(True, jax.lax.axis_index("pipe"), 1, v))
    with pytest.raises(TypeError, match="must be one integer"):
        run(lambda v: ops.send_recv(True, 0.0, 1, v))
    with pytest.raises(ValueError, match="send: input_signal is false"):
        run(lambda v: ops.send(np.array(False), 1, v, tag=0))
    with pytest.raises(TypeError, match="send: input_signal must be bool"):
        run(lambda v: ops.send(np.int64(1), 1, v, tag=0))
    with pytest.raises(TypeError, match=r"element_types\[0\] is int32 but Data 0 is float32"):
        run(lambda v: ops.send(True, 1, v, tag=0, element_types=[6]))
    with pytest.raises(ValueError, match="lists 2 types for 1"):
        run(lambda v: ops.send(True, 1, v, tag=0, element_types=[1, 1]))
    with pytest.raises(TypeError, match="pass send="):
        run(lambda v: ops.recv(True, 0, tag=0))
    with pytest.raises(ValueError, match="tag 1 does not match the Send's tag 0"):
        run(lambda v: ops.recv(True, 0, tag=1, send=ops.send(True, 1, v, tag=0)))
    with pytest.raises(TypeError, match="complex64"):
        run(lambda v: ops.send_recv(True, 0, 1, v.astype(jnp.complex64)))
    with pytest.raises(ValueError, match="at least one tensor"):
        run(lambda v: ops.send_recv(True, 0, 1))


def test_ort_ops_table():
    assert ops.ORT_OPS[("com.microsoft", "Send")] is ops.send
    assert ops.ORT_OPS[("com.microsoft", "Recv")] is ops.recv


# -- the importer: a 2-stage pipeline as one SPMD graph ------------------------------------

D = 6


def _pipeline_model(remote_from_input=False, send_remote=1, recv_remote=0, recv_types=(1,),
                    second_send=False):
    """Stage s (on pipeline rank s) computes tanh(h @ W) with its own W: rank 0 from x, rank 1
    from what rank 0 sent. Output y is meaningful on rank 1."""
    f, i64, b = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    inits = [helper.make_tensor("sig", b, [], [True]),
             helper.make_tensor("W", f, [D, D], np.zeros(D * D))]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h0"]),
             helper.make_node("Tanh", ["h0"], ["a0"]),
             helper.make_node("Constant", [], ["to"], value_int=send_remote),
             helper.make_node("Send", ["sig", "to", "a0"], ["sent"], domain="com.microsoft",
                              name="send_fw", tag=0, element_types=[1]),
             helper.make_node("Recv", ["sig", "from"], ["received", "a_in"], name="recv_fw",
                              domain="com.microsoft", tag=0, element_types=list(recv_types)),
             helper.make_node("MatMul", ["a_in", "W"], ["h1"]),
             helper.make_node("Tanh", ["h1"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", f, [2, D])]
    if remote_from_input:
        inputs.append(helper.make_tensor_value_info("from", i64, []))
    else:
        inits.append(helper.make_tensor("from", i64, [], [recv_remote]))
    if second_send:
        nodes.append(helper.make_node("Send", ["sig", "to", "y"], ["sent2"], tag=0,
                                      domain="com.microsoft", element_types=[1]))
    graph = helper.make_graph(nodes, "pipeline", inputs,
                              [helper.make_tensor_value_info("y", f, [2, D]),
                               helper.make_tensor_value_info("sent", b, []),
                               helper.make_tensor_value_info("received", b, [])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def test_imported_pipeline_equals_single_device(rng):
    program = jaxops.onnx.load(_pipeline_model())
    assert set(program.params) == {"W"}
    mesh = _mesh(2)
    x = rng.standard_normal((2, D)).astype(np.float32)
    ws = (rng.standard_normal((2, D, D)) / np.sqrt(D)).astype(np.float32)  # stage s: ws[s]

    def run(ws, x):
        return _per_rank(lambda w, x: program({"W": w}, x), mesh, ws, x, replicated=(1,))

    y, sent, received = run(ws, x)
    want = np.tanh(np.tanh(x @ ws[0]) @ ws[1])
    np.testing.assert_allclose(y[1], want, rtol=1e-5, atol=1e-6)
    assert sent.all() and received.all()
    # gradients reach both stages' weights through the transfer
    loss = lambda ws: jnp.sum(run(ws, x)[0][1] ** 2)
    single = lambda ws: jnp.sum(jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]) ** 2)
    np.testing.assert_allclose(jax.grad(loss)(ws), jax.grad(single)(ws), rtol=1e-4, atol=1e-6)


def test_importer_refuses_what_it_cannot_pair():
    with pytest.raises(OnnxImportError, match="'recv_fw' .*takes its Remote rank from 'from', "
                                              "which is not a constant"):
        jaxops.onnx.load(_pipeline_model(remote_from_input=True))
    with pytest.raises(OnnxImportError, match="sends to rank 1 .*receives from rank 1: a rank "
                                              "sending to itself"):
        jaxops.onnx.load(_pipeline_model(recv_remote=1))
    with pytest.raises(OnnxImportError, match=r"element_types \[1\] .*expects \[7\]"):
        jaxops.onnx.load(_pipeline_model(recv_types=(7,)))
    with pytest.raises(OnnxImportError, match="tag 0 has 2 Send and 1 Recv"):
        jaxops.onnx.load(_pipeline_model(second_send=True))


def test_imported_pipeline_rank_outside_the_axis(rng):
    program = jaxops.onnx.load(_pipeline_model(send_remote=5))
    mesh = _mesh(2)
    # ops.send's own error, naming the node that runs the transfer
    with pytest.raises(ValueError, match="destination rank 5 is outside the 2 ranks") as e:
        _per_rank(lambda w, x: program({"W": w}, x), mesh, np.zeros((2, D, D), np.float32),
                  np.zeros((2, D), np.float32), replicated=(1,))
    assert any("while running node" in n and "SendRecv" in n for n in e.value.__notes__)


def test_model_without_send_recv_is_not_copied():
    from jaxops.onnx.handlers.p2p import pair_transfers

    model = _pipeline_model()
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    del graph.node[3:5]
    assert pair_transfers(graph) is graph
    fused = pair_transfers(model.graph)
    assert [n.op_type for n in fused.node].count("SendRecv") == 1
    assert [n.op_type for n in model.graph.node].count("Send") == 1  # the caller's is intact
