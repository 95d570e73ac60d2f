"""An ONNX model rewritten to compute in float64: the arbiter where two float32 results
(jaxops' and ORT's) disagree. Every float32 tensor, type, Cast and dtype attribute becomes
float64; everything else is left as it is."""
import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

F32, F64 = TensorProto.FLOAT, TensorProto.DOUBLE
# attributes that name an element type
_TYPE_ATTRS = ("to", "dtype", "output_datatype")


def _tensor(t: onnx.TensorProto) -> None:
    if t.data_type == F32:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))


def _type(tp: onnx.TypeProto) -> None:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type" and tp.tensor_type.elem_type == F32:
        tp.tensor_type.elem_type = F64
    elif kind == "sequence_type":
        _type(tp.sequence_type.elem_type)
    elif kind == "optional_type":
        _type(tp.optional_type.elem_type)


def _graph(g: onnx.GraphProto) -> None:
    for t in g.initializer:
        _tensor(t)
    for v in (*g.input, *g.output, *g.value_info):
        _type(v.type)
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                _tensor(a.t)
            elif a.type == onnx.AttributeProto.INT and a.name in _TYPE_ATTRS and a.i == F32:
                a.i = F64
            elif a.type == onnx.AttributeProto.GRAPH:
                _graph(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    _graph(sub)


def float64_model(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _graph(out.graph)
    return out
