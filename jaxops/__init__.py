"""jaxops: ONNX Runtime's training kernels as differentiable JAX primitives."""
from jaxops import nn, ops

__version__ = "0.1.0"
__all__ = ["nn", "ops"]
