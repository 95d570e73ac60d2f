"""ONNX op handlers, keyed by (domain, op_type, since_version).

A handler is registered for the opset version that introduced its semantics; a model asking
for a later version gets the newest handler at or below it (so a version that changed nothing
we care about needs no entry).

    @handler("Gemm", since=11)
    def gemm(ctx, A, B, C=None, *, alpha=1.0, beta=1.0, transA=0, transB=0): ...

A handler receives the node's inputs positionally (an absent optional input is None; a
sequence is a Python list; static values such as shapes may arrive as numpy arrays) and the
node's attributes as keyword arguments under their ONNX names, decoded to Python values
(int, float, str, lists of those, numpy arrays for tensors, onnx GraphProto for subgraphs).
It returns one value, or a tuple with one entry per node output. `ctx` is the importer's view
of the node (see `jaxops.onnx.program.NodeContext`): `ctx.static(x, what)` turns a value into
numpy or raises an import error naming the node when it is data-dependent, `ctx.num_outputs`,
`ctx.opset(domain)`, `ctx.run_graph(graph, *inputs)` for subgraphs.
"""
from __future__ import annotations

import bisect
from typing import Callable

# (domain, op_type) -> sorted [(since_version, handler)]
_HANDLERS: dict[tuple[str, str], list[tuple[int, Callable]]] = {}


def canonical_domain(domain: str) -> str:
    """A domain's one spelling: ONNX's default domain is "" (a model may write "ai.onnx")."""
    return "" if domain in ("", "ai.onnx") else domain


def _key(domain: str, op_type: str) -> tuple[str, str]:
    return (canonical_domain(domain), op_type)


def handler(op_type: str, since: int = 1, domain: str = ""):
    """Registers the decorated function for `op_type` from opset `since` on."""

    def register(fn):
        entries = _HANDLERS.setdefault(_key(domain, op_type), [])
        if any(v == since for v, _ in entries):
            raise ValueError(f"two handlers for ({domain!r}, {op_type!r}, {since})")
        bisect.insort(entries, (since, fn), key=lambda e: e[0])
        return fn

    return register


def lookup(domain: str, op_type: str, version: int) -> Callable | None:
    """The handler for the newest since_version <= version, or None."""
    entries = _HANDLERS.get(_key(domain, op_type), [])
    i = bisect.bisect_right([v for v, _ in entries], version)
    return entries[i - 1][1] if i else None


def registered() -> dict[tuple[str, str], list[int]]:
    """Every (domain, op_type) with the since_versions that have handlers."""
    return {k: [v for v, _ in e] for k, e in sorted(_HANDLERS.items())}
