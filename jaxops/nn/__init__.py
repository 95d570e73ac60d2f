"""Differentiable building blocks whose gradients run jaxops kernels."""
from jaxops.nn.softmax import log_softmax, softmax

__all__ = ["log_softmax", "softmax"]
