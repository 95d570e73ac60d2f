"""com.microsoft Send / Recv in an SPMD graph: each Send is paired with its Recv at load time.

ORT's pipeline graphs give each stage its own graph and let MPI/NCCL match a Send on one rank
with a Recv on another. jaxops runs one program on every rank (see jaxops.ops.p2p), so it
takes ONE graph holding both halves of each transfer and pairs them when the model loads:

- the k-th Send with attribute tag t pairs with the k-th Recv with tag t, in node order (MPI
  matches messages of one tag in the order they were sent); a tag whose Send and Recv counts
  differ is refused;
- a Send's Remote is the destination rank, its Recv's Remote the source rank; both must be
  constants (an initializer or a Constant node of the same graph), so the transfer is known
  before the data; a pair whose source is its destination is refused, as ORT refuses a send
  to its own rank;
- the two element_types attributes must agree.

Each pair becomes one node of the importer's own domain (`jaxops.internal`, SendRecv), which
runs `jaxops.ops.send` and `jaxops.ops.recv` together: one ppermute along the pipeline axis
(`jaxops.ops.PIPELINE_AXIS`, "pipe"; override with `with jaxops.ops.pipeline_axis(...)`
around the call). Its outputs are the Send's OutputSignal, the Recv's OutputSignal and the
Recv's data. The model's own graph (and its subgraphs) are rewritten on a copy; a model with
no Send or Recv is used as it is.
"""
from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import numpy_helper

from jaxops.onnx.errors import OnnxImportError
from jaxops.onnx.registry import canonical_domain, handler

DOMAIN = "jaxops.internal"
_MS = ("com.microsoft",)
_A = onnx.AttributeProto


def _is_p2p(node) -> bool:
    return node.domain in _MS and node.op_type in ("Send", "Recv")


def _holds_p2p(graph) -> bool:
    for node in graph.node:
        if _is_p2p(node):
            return True
        for a in node.attribute:
            subs = [a.g] if a.type == _A.GRAPH else list(a.graphs) if a.type == _A.GRAPHS else []
            if any(_holds_p2p(g) for g in subs):
                return True
    return False


def pair_transfers(graph: onnx.GraphProto) -> onnx.GraphProto:
    """`graph` with every Send/Recv pair fused into one node (a copy), or `graph` itself when
    it holds no Send or Recv."""
    if not _holds_p2p(graph):
        return graph
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    _rewrite(copy, "the model's graph")
    return copy


def _label(node) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"a {node.op_type} node"


def _attr(node, name, where):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    raise OnnxImportError(f"{where}: {_label(node)} lacks its required attribute {name!r}")


def _constants(graph) -> dict:
    """Integer values the graph fixes before any data: initializers and Constant nodes."""
    values = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and not canonical_domain(node.domain) and node.output:
            for a in node.attribute:
                if a.name == "value":
                    values[node.output[0]] = a.t
                elif a.name in ("value_int", "value_ints"):
                    values[node.output[0]] = np.asarray(onnx.helper.get_attribute_value(a))
    return values


def _rank(node, constants, where) -> int:
    name = node.input[1] if len(node.input) > 1 else ""
    value = constants.get(name) if name else None
    if value is None:
        raise OnnxImportError(
            f"{where}: {_label(node)} takes its Remote rank from {name!r}, which is not a "
            "constant (an initializer or a Constant node); jaxops needs every rank known when "
            "the model loads, to pair Send with Recv")
    if isinstance(value, onnx.TensorProto):
        value = numpy_helper.to_array(value)
    value = np.asarray(value)
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
        raise OnnxImportError(f"{where}: {_label(node)}: Remote must be one integer, got "
                              f"{value.dtype}{list(value.shape)}")
    return int(value.reshape(()))


def _rewrite(graph, where):
    for node in graph.node:
        for a in node.attribute:
            subs = [a.g] if a.type == _A.GRAPH else list(a.graphs) if a.type == _A.GRAPHS else []
            for g in subs:
                _rewrite(g, f"subgraph {g.name!r}")
    constants = _constants(graph)
    queues = {"Send": collections.defaultdict(list), "Recv": collections.defaultdict(list)}
    for i, node in enumerate(graph.node):
        if _is_p2p(node):
            queues[node.op_type][int(_attr(node, "tag", where))].append(i)
    tags = set(queues["Send"]) | set(queues["Recv"])
    fused = {}  # index of the Recv -> the fused node; the Send's index -> None
    for tag in sorted(tags):
        sends, recvs = queues["Send"][tag], queues["Recv"][tag]
        if len(sends) != len(recvs):
            raise OnnxImportError(
                f"{where}: tag {tag} has {len(sends)} Send and {len(recvs)} Recv node(s); under "
                "SPMD each Send needs the Recv of the same transfer in the same graph")
        for s, r in zip(sends, recvs):
            fused[r] = _fuse(graph.node[s], graph.node[r], constants, where)
            fused[s] = None
    nodes = [fused.get(i, node) for i, node in enumerate(graph.node)]
    del graph.node[:]
    graph.node.extend(n for n in nodes if n is not None)


def _fuse(send, recv, constants, where):
    destination, source = _rank(send, constants, where), _rank(recv, constants, where)
    if source == destination:
        raise OnnxImportError(
            f"{where}: {_label(send)} sends to rank {destination} and its {_label(recv)} "
            f"receives from rank {source}: a rank sending to itself, which ORT refuses")
    send_types = list(_attr(send, "element_types", where))
    recv_types = list(_attr(recv, "element_types", where))
    if send_types != recv_types:
        raise OnnxImportError(f"{where}: {_label(send)} sends element_types {send_types} but its "
                              f"{_label(recv)} expects {recv_types}")
    if len(send.input) < 2 or len(recv.input) < 2 or not send.output or not recv.output:
        raise OnnxImportError(f"{where}: {_label(send)} / {_label(recv)} lack their signal and "
                              "Remote inputs or their OutputSignal")
    return onnx.helper.make_node(
        "SendRecv", [*send.input[:2], *recv.input[:2], *send.input[2:]],
        [send.output[0], *recv.output], name=f"{send.name or 'Send'}+{recv.name or 'Recv'}",
        domain=DOMAIN, tag=int(_attr(send, "tag", where)), element_types=send_types)


@handler("SendRecv", domain=DOMAIN)
def send_recv(ctx, send_signal, destination, recv_signal, source, *data, tag, element_types):
    """One Send and its Recv: (Send's OutputSignal, Recv's OutputSignal, *received)."""
    from jaxops import ops  # late: the op families load jax kernels

    pending = ops.send(send_signal, destination, *data, tag=tag, element_types=element_types)
    signal, *received = ops.recv(recv_signal, source, tag=tag, element_types=element_types,
                                 send=pending)
    return (signal, signal, *received)
