"""ONNX models as JAX functions.

    program = jaxops.onnx.load("model.onnx")
    outputs = program(program.params, x)            # or program(program.params, input_name=x)
    grads = jax.grad(lambda p: loss(program(p, x)))(program.params)
    forward = program.jit()                          # inference: y = forward(x), params fixed

Float initializers become `program.params` (a dict pytree; device arrays but the small ones,
which stay numpy as shape arithmetic may read them); integer and bool
initializers and Constant nodes stay numpy, so shape arithmetic (Shape -> Gather -> Concat ->
Reshape) resolves while tracing. ai.onnx nodes run through the handlers in
`jaxops.onnx.handlers`, com.microsoft nodes through `jaxops.ops.ORT_OPS`.
"""
from jaxops.onnx.errors import OnnxImportError
from jaxops.onnx.loader import load, read_model
from jaxops.onnx.program import NodeContext, Program

__all__ = ["NodeContext", "OnnxImportError", "Program", "load", "read_model"]
