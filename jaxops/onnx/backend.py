"""jaxops as an `onnx.backend.base.Backend`, so `onnx.backend.test.BackendTest` can run the
ONNX node suite through the importer:

    import jaxops.onnx.backend as backend
    rep = backend.prepare(model)          # a Program; params bound
    outputs = rep.run([x, y])             # numpy arrays (lists for sequences)

Runs eagerly (each jnp op compiled once per shape), which is what a suite of thousands of
one-node models wants; wrap `rep.program` in `jax.jit` for repeated calls.
"""
from __future__ import annotations

import jax
import numpy as np
import onnx
from onnx import helper
from onnx.backend.base import Backend, BackendRep, namedtupledict

from jaxops.onnx.loader import load


class JaxopsRep(BackendRep):
    def __init__(self, program):
        self.program = program
        graph = program.model.graph
        declared = {vi.name: vi.type for vi in graph.output}
        self._out_types = [declared.get(n) for n in program.output_names]

    def run(self, inputs, **kwargs):
        p = self.program
        if isinstance(inputs, dict):
            outs = p.run(p.params, **inputs)
        else:
            if not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            outs = p.run(p.params, *inputs)
        outs = [_to_numpy(o, t) for o, t in zip(outs, self._out_types)]
        return namedtupledict("Outputs", p.output_names)(*outs)


def _to_numpy(x, type_proto):
    """A result as numpy, in the graph's declared dtype where 64-bit types are off in jax."""
    if x is None or isinstance(x, np.ndarray) and x.dtype == object:
        return x
    if isinstance(x, (list, tuple)):
        elem = (type_proto.sequence_type.elem_type
                if type_proto is not None and type_proto.HasField("sequence_type") else None)
        return [_to_numpy(v, elem) for v in x]
    if type_proto is not None and type_proto.HasField("optional_type"):
        return _to_numpy(x, type_proto.optional_type.elem_type)
    out = np.asarray(x)
    if (type_proto is not None and type_proto.HasField("tensor_type")
            and type_proto.tensor_type.elem_type):
        want = helper.tensor_dtype_to_np_dtype(type_proto.tensor_type.elem_type)
        if out.dtype != want and out.dtype.itemsize * 2 == np.dtype(want).itemsize \
                and not jax.config.jax_enable_x64:
            out = out.astype(want)  # jax computed it in 32 bits: report the declared type
    return out


class JaxopsBackend(Backend):
    @classmethod
    def is_compatible(cls, model, device="CPU", **kwargs):
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        # load() does its own checking (the base class's onnx.checker pass would reject
        # models the importer runs, e.g. ORT's, and raise its own error type)
        return JaxopsRep(load(model, **kwargs))

    @classmethod
    def run_model(cls, model, inputs, device="CPU", **kwargs):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node, inputs, device="CPU", outputs_info=None, **kwargs):
        """One node on numpy inputs (the node's input names, in order)."""
        values = [np.asarray(x) for x in inputs]
        graph = helper.make_graph(
            [node], "node",
            [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
             for n, v in zip(node.input, values)],
            [helper.make_empty_tensor_value_info(n) for n in node.output if n])
        opset = kwargs.pop("opset_version", onnx.defs.onnx_opset_version())
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        return cls.run_model(model, values, device, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        kind = device.split(":")[0].upper()
        if kind == "CPU":
            return True
        if kind == "CUDA":
            try:
                return bool(jax.devices("gpu"))
            except RuntimeError:
                return False
        return False


prepare = JaxopsBackend.prepare
run_model = JaxopsBackend.run_model
run_node = JaxopsBackend.run_node
supports_device = JaxopsBackend.supports_device
is_compatible = JaxopsBackend.is_compatible
