"""RecordEvent, WaitEvent (pipeline ordering) and YieldOp, PythonOp, PythonOpGrad, TritonOp
(framework interop), com.microsoft.

RecordEvent/WaitEvent order work across pipeline stages in ORT through an event pool. In
one XLA program the order that matters is data order, so both pass their inputs through an
optimization barrier: nothing computed from the outputs can move before all the inputs are
ready, and the inputs are not recomputed or fused past it. The event id is checked and
otherwise unused (there is no event pool to signal).

The interop ops name Python (or Triton) code for ORT to run. jaxops never imports or runs code
named by a model: a function runs only if the caller registered it under that name with
`register_python_function`.
"""
from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

_FUNCTIONS: dict[str, Callable] = {}


def _check_event(op, event_id):
    event = jnp.asarray(event_id)
    if event.dtype != jnp.int64 and event.dtype != jnp.int32:
        raise TypeError(f"jaxops.ops.{op}: EventIdentifier must be int64, got {event.dtype}")
    if event.size != 1:
        raise ValueError(f"jaxops.ops.{op}: EventIdentifier must hold one value, got shape {event.shape}")


def _barrier(inputs):
    out = lax.optimization_barrier(tuple(jnp.asarray(x) for x in inputs))
    return out[0] if len(out) == 1 else tuple(out)


def record_event(event_id, *inputs):
    """Passes `inputs` through once all of them are computed (ORT: then signals the event)."""
    _check_event("record_event", event_id)
    return _barrier(inputs) if inputs else None


def wait_event(event_id, *inputs):
    """Passes `inputs` through once all of them are computed (ORT: after the event fired)."""
    _check_event("wait_event", event_id)
    return _barrier(inputs) if inputs else None


def register_python_function(name: str, fn: Callable | None) -> None:
    """Lets PythonOp / PythonOpGrad / TritonOp nodes naming `name` call `fn` (None removes it).

    PythonOp calls fn(*inputs, **attributes) -> outputs (a context handle is prepended, as
    ORT's output 0); PythonOpGrad calls fn(*grad_inputs, **attributes) with the context
    dropped; TritonOp calls fn(*inputs, **attributes)."""
    if fn is None:
        _FUNCTIONS.pop(name, None)
    else:
        if not callable(fn):
            raise TypeError(f"register_python_function: {name!r} needs a callable")
        _FUNCTIONS[name] = fn


def _registered(op, name):
    if not name:
        raise ValueError(f"jaxops.ops.{op}: the node names no function (func_name is empty)")
    if name not in _FUNCTIONS:
        raise ValueError(f"jaxops.ops.{op}: refusing to run {name!r}: jaxops never imports code "
                         "a model names; register an implementation with "
                         "jaxops.ops.register_python_function(name, fn)")
    return _FUNCTIONS[name]


def _tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def python_op(*inputs, func_name="", **attributes):
    """ORT's PythonOp: (context, *outputs) from the registered function."""
    out = _tuple(_registered("python_op", func_name)(*inputs, **attributes))
    return (jnp.zeros((), jnp.int64), *out)


def python_op_grad(context, *inputs, func_name="", **attributes):
    """ORT's PythonOpGrad: the registered backward, given the gradients (context dropped)."""
    out = _tuple(_registered("python_op_grad", func_name)(*inputs, **attributes))
    return out[0] if len(out) == 1 else out


def triton_op(*inputs, func_name="", **attributes):
    out = _tuple(_registered("triton_op", func_name)(*inputs, **attributes))
    return out[0] if len(out) == 1 else out


def yield_op(*module_outputs, non_differentiable_outputs=(), full_shape_outputs=(),
             gradient_fn: Callable | None = None):
    """ORT's YieldOp hands the forward outputs to PyTorch and returns the gradients PyTorch
    sends back. In JAX, jax.grad differentiates the whole program, so an imported graph
    rarely needs it; pass `gradient_fn(*differentiable_outputs) -> gradients` to supply them."""
    if gradient_fn is None:
        raise ValueError("jaxops.ops.yield_op: YieldOp is where ORTModule hands control to "
                         "PyTorch; pass gradient_fn= to supply the output gradients")
    skip = set(non_differentiable_outputs or ())
    outs = [x for i, x in enumerate(module_outputs) if i not in skip]
    grads = _tuple(gradient_fn(*outs))
    if len(grads) != len(outs):
        raise ValueError(f"jaxops.ops.yield_op: gradient_fn returned {len(grads)} gradients "
                         f"for {len(outs)} differentiable outputs")
    return grads[0] if len(grads) == 1 else grads


__all__ = ["python_op", "python_op_grad", "record_event", "register_python_function",
           "triton_op", "wait_event", "yield_op"]

_MS = "com.microsoft"
ORT_OPS = {
    (_MS, "RecordEvent"): record_event,
    (_MS, "WaitEvent"): wait_event,
    (_MS, "YieldOp"): yield_op,
    (_MS, "PythonOp"): python_op,
    (_MS, "PythonOpGrad"): python_op_grad,
    (_MS, "TritonOp"): triton_op,
}
