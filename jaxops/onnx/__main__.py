"""python -m jaxops.onnx inspect MODEL.onnx

Prints what the importer makes of a model: the op census by (domain, op_type, opset version)
with each op supported or not, the params (count, bytes), the inputs and outputs with their
types and shapes. Exits 1 when an op is unsupported or the model is malformed.
"""
from __future__ import annotations

import argparse
import collections
import sys

import numpy as np
import onnx
from onnx import helper

from jaxops.onnx.errors import OnnxImportError
from jaxops.onnx.loader import read_model
from jaxops.onnx.program import is_trainable, subgraphs
from jaxops.onnx.registry import canonical_domain


def _type_text(t: onnx.TypeProto) -> str:
    kind = t.WhichOneof("value")
    if kind == "tensor_type":
        elem = (helper.tensor_dtype_to_string(t.tensor_type.elem_type).removeprefix("TensorProto.")
                if t.tensor_type.elem_type else "?")
        if not t.tensor_type.HasField("shape"):
            return f"{elem}[...]"
        dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                for d in t.tensor_type.shape.dim]
        return f"{elem}[{', '.join(dims)}]"
    if kind == "sequence_type":
        return f"sequence<{_type_text(t.sequence_type.elem_type)}>"
    if kind == "optional_type":
        return f"optional<{_type_text(t.optional_type.elem_type)}>"
    return kind or "?"


def _census(graph, opsets, counts):
    for node in graph.node:
        domain = canonical_domain(node.domain)
        counts[(domain, node.op_type, opsets.get(domain, 1))] += 1
        for g in subgraphs(node):
            _census(g, opsets, counts)


def inspect(path: str, out=sys.stdout) -> int:
    from jaxops.onnx import resolve  # imports every handler

    try:
        model = read_model(path)
    except OnnxImportError as e:
        print(f"error: {e}", file=out)
        return 1
    opsets = {canonical_domain(o.domain): o.version for o in model.opset_import}
    functions = {(canonical_domain(f.domain), f.name) for f in model.functions}
    counts = collections.Counter()
    _census(model.graph, opsets, counts)
    print(f"model {path}: ir_version {model.ir_version}, producer "
          f"{model.producer_name or '?'} {model.producer_version}".rstrip(), file=out)
    print("opsets: " + ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in sorted(opsets.items())),
          file=out)
    print(f"\nops ({sum(counts.values())} nodes, {len(counts)} kinds):", file=out)
    missing = 0
    for (domain, op, version), n in sorted(counts.items(), key=repr):
        ok = (domain, op) in functions or resolve.is_supported(domain, op, version)
        missing += not ok
        print(f"  {'ok  ' if ok else 'MISSING'}  {domain or 'ai.onnx'} {op} v{version}  x{n}",
              file=out)
    init_names = {t.name for t in model.graph.initializer}
    n_params = n_bytes = 0
    for t in model.graph.initializer:
        try:
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        except (KeyError, ValueError):
            continue  # malformed: load() says so
        if is_trainable(dtype):
            n = int(np.prod(tuple(t.dims)))
            n_params += n
            n_bytes += n * dtype.itemsize
    print(f"\nparams: {n_params:,} values in float initializers, {n_bytes:,} bytes "
          f"({len(model.graph.initializer)} initializers)", file=out)
    print("\ninputs:", file=out)
    for vi in model.graph.input:
        if vi.name not in init_names:
            print(f"  {vi.name}: {_type_text(vi.type)}", file=out)
    print("outputs:", file=out)
    for vi in model.graph.output:
        print(f"  {vi.name}: {_type_text(vi.type)}", file=out)
    if missing:
        print(f"\n{missing} op kind(s) unsupported", file=out)
    return 1 if missing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxops.onnx")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="op census, params, inputs and outputs of a model")
    p.add_argument("model")
    args = parser.parse_args(argv)
    return inspect(args.model)


if __name__ == "__main__":
    sys.exit(main())
