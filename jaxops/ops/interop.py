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

from jaxops._src import rules
from jaxops._src.spec import define

_FUNCTIONS: dict[str, Callable] = {}
_MS = "com.microsoft"


def _check_event(event_id, *inputs):
    if event_id.size != 1:
        raise ValueError(f"event_id (ORT's EventIdentifier) must hold one value, got shape "
                         f"{event_id.shape}")


def _barrier(event_id, *inputs):
    if not inputs:
        return None
    out = lax.optimization_barrier(inputs)
    return out[0] if len(out) == 1 else tuple(out)


# the event id is a one-element first input, which the generic matrix would batch like the data
_EVENT_NO_MATRIX = ("its first input is a one-element event id, which the generic matrix "
                    "(tests/test_op_matrix.py) would stack and batch like the data inputs; "
                    "tests/test_interop.py checks jit, vmap and check_grads order 2")

record_event = define(
    "record_event", ort=(_MS, "RecordEvent"), inputs=("event_id: index", "*inputs: array"),
    outputs=("OutputData",), check=_check_event, reference=_barrier,
    no_matrix=_EVENT_NO_MATRIX,
    doc="""Passes `inputs` through once all of them are computed (ORT: then signals the event).""")

wait_event = define(
    "wait_event", ort=(_MS, "WaitEvent"), inputs=("event_id: index", "*inputs: array"),
    outputs=("OutputData",), check=_check_event, reference=_barrier,
    no_matrix=_EVENT_NO_MATRIX,
    doc="""Passes `inputs` through once all of them are computed (ORT: after the event fired).""")


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


def _registered(*inputs, func_name, **attributes):
    """The check of the interop ops: `func_name` names a registered function."""
    if not func_name:
        raise ValueError("the node names no function (func_name is empty)")
    if func_name not in _FUNCTIONS:
        raise ValueError(f"refusing to run {func_name!r}: jaxops never imports code a model "
                         "names; register an implementation with "
                         "jaxops.ops.register_python_function(name, fn)")


def _tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _one_or_tuple(out):
    out = _tuple(out)
    return out[0] if len(out) == 1 else out


_PYTHON_NO_MATRIX = "runs a caller-registered Python function: nothing generic to transform"


def _python_op(*inputs, func_name, **attributes):
    out = _tuple(_FUNCTIONS[func_name](*inputs, **attributes))
    return (jnp.zeros((), jnp.int64), *out)


python_op = define(
    "python_op", ort=(_MS, "PythonOp"), inputs=("*inputs: any",),
    outputs=("context", "outputs"), attrs={"func_name": ""}, extra_attrs=True,
    check=_registered, reference=_python_op, no_matrix=_PYTHON_NO_MATRIX,
    doc="""ORT's PythonOp: (context, *outputs) from the registered function, called with the
    inputs and the node's other attributes (see register_python_function).""")

python_op_grad = define(
    "python_op_grad", ort=(_MS, "PythonOpGrad"), inputs=("context: any", "*inputs: any"),
    outputs=("outputs",), attrs={"func_name": ""}, extra_attrs=True,
    check=lambda context, *inputs, **attrs: _registered(*inputs, **attrs),
    reference=lambda context, *inputs, func_name, **attributes: _one_or_tuple(
        _FUNCTIONS[func_name](*inputs, **attributes)),
    no_matrix=_PYTHON_NO_MATRIX,
    doc="""ORT's PythonOpGrad: the registered backward, given the gradients (context dropped).""")

triton_op = define(
    "triton_op", ort=(_MS, "TritonOp"), inputs=("*inputs: any",), outputs=("outputs",),
    attrs={"func_name": ""}, extra_attrs=True, check=_registered,
    reference=lambda *inputs, func_name, **attributes: _one_or_tuple(
        _FUNCTIONS[func_name](*inputs, **attributes)),
    no_matrix=_PYTHON_NO_MATRIX,
    doc="""ORT's TritonOp: the registered function, called with the inputs and the node's other
    attributes (onnx_key, onnx_string, ...).""")


def _yield_check(*module_outputs, non_differentiable_outputs, full_shape_outputs, gradient_fn):
    if gradient_fn is None:
        raise ValueError("YieldOp is where ORTModule hands control to PyTorch; pass "
                         "gradient_fn= to supply the output gradients")


def _yield(*module_outputs, non_differentiable_outputs, full_shape_outputs, gradient_fn):
    skip = set(non_differentiable_outputs or ())
    outs = [x for i, x in enumerate(module_outputs) if i not in skip]
    grads = _tuple(gradient_fn(*outs))
    if len(grads) != len(outs):
        with rules.named("yield_op"):
            raise ValueError(f"gradient_fn returned {len(grads)} gradients for {len(outs)} "
                             "differentiable outputs")
    return grads[0] if len(grads) == 1 else grads


yield_op = define(
    "yield_op", ort=(_MS, "YieldOp"), inputs=("*module_outputs: any",),
    outputs=("module_outputs_grad",),
    attrs={"non_differentiable_outputs": (), "full_shape_outputs": ()},
    options={"gradient_fn": None}, check=_yield_check, reference=_yield,
    no_matrix="hands the outputs to a caller-supplied gradient_fn (ORTModule's hand-off to "
              "PyTorch): nothing generic to transform",
    doc="""ORT's YieldOp hands the forward outputs to PyTorch and returns the gradients PyTorch
    sends back. In JAX, jax.grad differentiates the whole program, so an imported graph
    rarely needs it; pass `gradient_fn(*differentiable_outputs) -> gradients` to supply them.""")


__all__ = ["python_op", "python_op_grad", "record_event", "register_python_function",
           "triton_op", "wait_event", "yield_op"]
