"""com.microsoft nodes (and ORT's ONNX-domain extras such as MaxPoolGrad) through
`jaxops.ops.ORT_OPS`, with nothing op-specific here: the node's inputs go positionally (an
absent optional input is None, a sequence a list), its attributes as keyword arguments under
ORT's names, and several outputs come back as a tuple in ORT's order. A new ORT_OPS entry is
importable as soon as it exists. Ops that ORT runs in place (optimizers, accumulators) report
their new values through `ctx.update`, so `Program.run_with_updates` returns them."""
from __future__ import annotations

from typing import Callable

from jaxops.onnx import registry
from jaxops.onnx.registry import canonical_domain

# ORT ops that update inputs in place (the graph names only their flag output): input index ->
# the output index of the new value, as the op's optional outputs give it.
IN_PLACE = {
    "InPlaceAccumulatorV2": {0: 1},
    "InPlaceAccumulator": {0: 0},
    "ZeroGradient": {0: 0},
    "InplaceClipGradNorm": {0: 0},
    "SGDOptimizerV2": {1: 1},
    "AdamWOptimizer": {2: 1, 4: 2, 5: 3},
}


def _table():
    """ORT_OPS under canonical domains."""
    from jaxops.ops import ORT_OPS  # late: the op families load jax kernels

    return {(canonical_domain(d), op): fn for (d, op), fn in ORT_OPS.items()}


def _requested(count):
    """`outputs=`: which of the op's `count` optional outputs the node asks for."""
    return lambda ctx: {"outputs": tuple(ctx.output_used(i) for i in range(count))}


def _forward_input_shape(ctx):
    """The shape of the forward pooling's input X, which a pooling gradient's output has:
    from the MaxPool whose Indices it reads, else from the pooling whose output's gradient
    (ORT names it `<Y>_grad`) it takes, else from its own output `<X>_grad`, else as the
    model declares that output (symbolic dims bound to this call's sizes)."""
    node = ctx.node
    forward = ctx.producer(node.input[1]) if len(node.input) > 1 else None
    if forward is None and node.input[0].endswith("_grad"):
        forward = ctx.producer(node.input[0][:-len("_grad")])
    if forward is not None and forward.op_type in ("MaxPool", "AveragePool") and forward.input:
        shape = ctx.shape_of(forward.input[0])
        if shape is not None:
            return shape
    out = node.output[0] if node.output else ""
    if out.endswith("_grad"):
        shape = ctx.shape_of(out[:-len("_grad")])
        if shape is not None:
            return shape
    return ctx.output_shape(0)


def _x_shape(op_type):
    """The pooling gradients take X's shape from the forward graph (ORT reads the declared
    shape of their output)."""
    def get(ctx):
        shape = _forward_input_shape(ctx)
        if shape is None:
            raise ctx.error(f"{op_type}: the shape of the forward input X is unknown: no "
                            "MaxPool/AveragePool feeds it and its output's shape is not declared")
        return {"x_shape": shape}
    return get


def _lamb_gradients(ctx):
    """LambOptimizer writes new gradients only where the graph names one (output 2 + 5i)."""
    return {"new_gradients": any(ctx.output_used(i) for i in range(2, ctx.num_outputs, 5))}


# Keywords some ops need from the graph itself, beyond the node's inputs and attributes.
GRAPH_KEYWORDS = {
    "LambOptimizer": _lamb_gradients,
    "ConvGrad": _requested(3),
    "ConvTransposeGrad": _requested(3),
    "DivGrad": _requested(2),
    "MaxPoolGrad": _x_shape("MaxPoolGrad"),
    "AveragePoolGrad": _x_shape("AveragePoolGrad"),
}


def _adapter(fn: Callable, op_type: str = "") -> Callable:
    in_place = IN_PLACE.get(op_type, {})
    extra = GRAPH_KEYWORDS.get(op_type)

    def run(ctx, *inputs, **attrs):
        if extra is not None:
            attrs.update(extra(ctx))
            if "x_shape" in attrs:  # a size from the graph, which the op fills before returning
                ctx.check_size(attrs["x_shape"], getattr(inputs[0], "dtype", "float32"))
        out = fn(*inputs, **attrs)
        results = out if isinstance(out, tuple) else (out,)
        for i, k in in_place.items():
            if k < len(results):
                ctx.update(i, results[k])
        if isinstance(out, tuple) and len(out) > ctx.num_outputs:
            out = out[:ctx.num_outputs]  # the graph uses only the leading outputs
        return out
    run.__name__ = run.__qualname__ = f"ort_{getattr(fn, '__name__', 'op')}"
    run.__doc__ = fn.__doc__
    return run


def ort_handler(domain: str, op_type: str) -> Callable | None:
    """The adapter for ORT_OPS[(domain, op_type)], or None; ONNX-domain entries (e.g.
    SoftmaxCrossEntropyLoss) are consulted only where no ai.onnx handler exists."""
    fn = _TABLE.get((canonical_domain(domain), op_type))
    return _adapter(fn, op_type) if fn is not None else None


def ort_keys():
    return list(_TABLE)


# Every other domain registers through the registry, so the census and `registered()` list it.
_TABLE = _table()
for (_domain, _op), _fn in sorted(_TABLE.items()):
    if _domain:
        registry.handler(_op, since=1, domain=_domain)(_adapter(_fn, _op))
