"""Patterns in an ONNX graph: what the importer's rewrites (fused_attention, fused_conv) match."""
from __future__ import annotations

import collections

import onnx

from ..registry import canonical_domain


def attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def is_op(node, op_type, domain="") -> bool:
    return node is not None and node.op_type == op_type and canonical_domain(node.domain) == domain


def subgraph_reads(graph) -> set[str]:
    """Every name the nodes of `graph`'s subgraphs (If/Loop/Scan bodies, nested) read."""
    names = set()
    for node in graph.node:
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                names |= {i for n in sub.node for i in n.input if i} | subgraph_reads(sub)
    return names


class Graph:
    """Producers and consumers of a graph's values."""

    def __init__(self, graph):
        self.nodes = list(graph.node)
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.consumers = collections.defaultdict(list)
        for n in self.nodes:
            for i in n.input:
                if i:
                    self.consumers[i].append(n)
        # values that leave the pattern's reach: the graph's outputs and what subgraphs read
        self.outputs = {v.name for v in graph.output} | subgraph_reads(graph)

    def only_consumer(self, name):
        """The one node that reads `name`, or None (several, none, or a graph output)."""
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None
