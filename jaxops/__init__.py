"""jaxops: ONNX Runtime's training kernels as differentiable JAX primitives."""
from jaxops import nn, ops
from jaxops.cpu import configure_cpu, cpu_device

__version__ = "0.1.0"
__all__ = ["configure_cpu", "cpu_device", "nn", "ops"]
