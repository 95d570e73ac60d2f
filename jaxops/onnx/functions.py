"""Function expansion: an ONNX FunctionProto (one a model defines, or the body ONNX's schema
gives an op) as a graph with the calling node's attributes bound, and the opsets it runs in.
`NodeContext.run_function` runs one; loading plans the bodies known before the input types."""
from __future__ import annotations

import onnx
from onnx import helper

from jaxops.onnx.registry import canonical_domain

_A = onnx.AttributeProto


def body_graph(f: onnx.FunctionProto, caller: onnx.NodeProto, defaults: dict) -> onnx.GraphProto:
    """`f`'s body as a graph, attribute references bound to `caller`'s attributes or else to
    `defaults` (name -> AttributeProto); references bound to neither are dropped."""
    nodes = [_bind_attrs(n, caller, defaults) for n in f.node]
    return helper.make_graph(nodes, f"{f.name}_expanded",
                             [helper.make_empty_tensor_value_info(n) for n in f.input],
                             [helper.make_empty_tensor_value_info(n) for n in f.output])


def body_opsets(f: onnx.FunctionProto, opsets: dict) -> dict:
    """The opsets of `f`'s body: the caller's `opsets`, overridden by those `f` imports."""
    return {**opsets, **{canonical_domain(o.domain): int(o.version) for o in f.opset_import}}


def _bind_attrs(node, caller, defaults):
    given = {a.name: a for a in caller.attribute}
    out = onnx.NodeProto()
    out.CopyFrom(node)
    del out.attribute[:]
    for a in node.attribute:
        if a.ref_attr_name:
            src = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
            if src is None:
                continue
            b = onnx.AttributeProto()
            b.CopyFrom(src)
            b.name = a.name
        else:
            b = onnx.AttributeProto()
            b.CopyFrom(a)
            if b.type == _A.GRAPH:
                _bind_graph(b.g, given, defaults)
            elif b.type == _A.GRAPHS:
                for g in b.graphs:
                    _bind_graph(g, given, defaults)
        out.attribute.append(b)
    return out


def _bind_graph(g, given, defaults):
    caller = onnx.NodeProto()
    caller.attribute.extend(given.values())
    bound = [_bind_attrs(n, caller, defaults) for n in g.node]
    del g.node[:]
    g.node.extend(bound)
