"""Which function runs a node, in this order: a function defined in the model; a registered
handler (`jaxops.onnx.registry`, ai.onnx and friends, com.microsoft through ORT_OPS); an
ORT_OPS entry of any other domain; the function body that the ONNX schema defines for the op
(e.g. Celu, MeanVarianceNormalization, the loss ops), expanded into its primitive ops."""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
import onnx.defs
from onnx import helper

import jaxops.onnx.handlers  # noqa: F401 - registers every handler module
from jaxops.onnx import functions, registry
from jaxops.onnx.errors import OnnxImportError
from jaxops.onnx.handlers import com_microsoft
from jaxops.onnx.registry import canonical_domain

_A = onnx.AttributeProto


def find(domain: str, op_type: str, version: int, program) -> Callable | None:
    f = program.functions.get((domain, op_type))
    if f is not None:
        return _model_function(f)
    fn = registry.lookup(domain, op_type, version)
    if fn is None:
        fn = com_microsoft.ort_handler(domain, op_type)
    if fn is None:
        fn = _schema_function(domain, op_type, version)
    return fn


def supported() -> dict[tuple[str, str], list[int]]:
    """(domain, op_type) -> the since_versions with a handler (schema functions not counted)."""
    table = registry.registered()
    for domain, op_type in com_microsoft.ort_keys():
        table.setdefault((domain, op_type), [1])
    return dict(sorted(table.items()))


def is_supported(domain: str, op_type: str, version: int) -> bool:
    return (registry.lookup(domain, op_type, version) is not None
            or com_microsoft.ort_handler(domain, op_type) is not None
            or _schema_function(domain, op_type, version) is not None)


def python_op(node, python_ops: dict) -> Callable | None:
    """ORT's PythonOp names a torch.autograd.Function by `func_name`: run only a function the
    caller handed over under that name, called as fn(*inputs, **attributes)."""
    name = next((a.s.decode("utf-8", "replace") for a in node.attribute
                 if a.name == "func_name"), None)
    fn = python_ops.get(name) if name is not None else None
    if fn is None:
        return None
    return lambda ctx, *inputs, **attrs: fn(*inputs, **attrs)


# -- functions -------------------------------------------------------------------------------

def function_body(node, version: int, program, opsets: dict):
    """(graph, opsets) of the body that a node without a handler expands to, where that is
    known before the input types are (model functions, plain schema functions); else None.
    Loading plans it, so that ops missing from the body are reported with the rest."""
    domain = canonical_domain(node.domain)
    f = program.functions.get((domain, node.op_type))
    if f is None:
        if registry.lookup(domain, node.op_type, version) or \
                com_microsoft.ort_handler(domain, node.op_type):
            return None
        try:
            schema = onnx.defs.get_schema(node.op_type, version, domain)
        except Exception:  # noqa: BLE001
            return None
        plain = [v for v in schema.function_opset_versions if v <= version]
        if not plain or [v for v in schema.context_dependent_function_opset_versions
                         if v <= version]:
            return None
        f = onnx.FunctionProto()
        f.ParseFromString(schema.get_function_with_opset_version(max(plain)))
        defaults = _schema_defaults(schema)
    else:
        defaults = {a.name: a for a in f.attribute_proto}
    return functions.body_graph(f, node, defaults), functions.body_opsets(f, opsets)


def _schema_defaults(schema) -> dict:
    """Attributes the caller leaves out take the schema's defaults inside the body too."""
    return {name: a.default_value for name, a in schema.attributes.items()
            if a.default_value.type != _A.UNDEFINED}


def _model_function(f: onnx.FunctionProto) -> Callable:
    defaults = {a.name: a for a in f.attribute_proto}

    def run(ctx, *inputs, **attrs):
        return tuple(ctx.run_function(f, inputs, defaults))
    return run


def _schema_function(domain: str, op_type: str, version: int) -> Callable | None:
    try:
        schema = onnx.defs.get_schema(op_type, version, domain)
    except Exception:  # noqa: BLE001 - onnx raises SchemaError for unknown ops
        return None
    plain = [v for v in schema.function_opset_versions if v <= version]
    context = [v for v in schema.context_dependent_function_opset_versions if v <= version]
    if not plain and not context:
        return None
    defaults = _schema_defaults(schema)

    def run(ctx, *inputs, **attrs):
        if context:
            types = [_type_of(x).SerializeToString() for x in inputs]
            body = schema.get_context_dependent_function_with_opset_version(
                max(context), ctx.node.SerializeToString(), types)
        else:
            body = schema.get_function_with_opset_version(max(plain))
        f = onnx.FunctionProto()
        f.ParseFromString(body)
        if not f.node:
            raise ctx.error("the ONNX schema gives no function body for these inputs")
        return tuple(ctx.run_function(f, inputs, defaults))
    return run


def _type_of(x) -> onnx.TypeProto:
    """The ONNX type of a runtime value, for the schema's context-dependent functions."""
    if x is None:
        return onnx.TypeProto()
    if isinstance(x, list):
        t = onnx.TypeProto()
        if x:
            t.sequence_type.elem_type.CopyFrom(_type_of(x[0]))
        return t
    dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
    try:
        elem = helper.np_dtype_to_tensor_dtype(dtype)
    except Exception:  # noqa: BLE001
        raise OnnxImportError(f"no ONNX type for dtype {dtype}") from None
    return helper.make_tensor_type_proto(elem, list(np.shape(x)))
