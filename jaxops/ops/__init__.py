"""ORT's training ops as JAX functions: `jaxops.ops.<snake_case ORT name>`.

Inputs are positional in ORT's order, attributes are keywords with ORT's names and defaults.
`ORT_OPS` maps (domain, op_type) to the function; the ONNX importer uses it and nothing else.
"""
from jaxops.ops.softmax import (log_softmax_grad, log_softmax_grad_13, softmax_grad,
                                softmax_grad_13)

MS = "com.microsoft"

ORT_OPS = {
    (MS, "SoftmaxGrad"): softmax_grad,
    (MS, "SoftmaxGrad_13"): softmax_grad_13,
    (MS, "LogSoftmaxGrad"): log_softmax_grad,
    (MS, "LogSoftmaxGrad_13"): log_softmax_grad_13,
}

__all__ = ["ORT_OPS", "log_softmax_grad", "log_softmax_grad_13", "softmax_grad",
           "softmax_grad_13"]
