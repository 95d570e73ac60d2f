"""Small ONNX models for the importer's tests, and a skip for ops without a handler yet."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from jaxops.onnx import resolve

FLOAT = TensorProto.FLOAT


def vi(name, elem=FLOAT, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def model(nodes, inputs, outputs, initializers=(), opset=17, domains=(), functions=()):
    """inputs/outputs: ValueInfoProtos or names (float, unknown shape); initializers: name ->
    numpy array."""
    inputs = [vi(i) if isinstance(i, str) else i for i in inputs]
    outputs = [vi(o) if isinstance(o, str) else o for o in outputs]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(initializers).items()]
    graph = helper.make_graph(nodes, "test", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    m = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    m.ir_version = 10  # onnxruntime 1.19 reads IR <= 10
    return m


def needs(*ops, domain="", version=21):
    """Skips a test until every op has a handler (ai.onnx handlers come from another branch)."""
    missing = [op for op in ops if not resolve.is_supported(domain, op, version)]
    return pytest.mark.skipif(bool(missing), reason=f"no handler yet for {missing}")
