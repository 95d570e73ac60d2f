"""com.microsoft nodes (and ORT's ONNX-domain extras such as MaxPoolGrad) through
`jaxops.ops.ORT_OPS`, with nothing op-specific here: the node's inputs go positionally (an
absent optional input is None, a sequence a list), its attributes as keyword arguments under
ORT's names, and several outputs come back as a tuple in ORT's order. A new ORT_OPS entry is
importable as soon as it exists. What an op needs beyond that comes from its spec
(jaxops/_src/spec.py): `outputs=` (which optional outputs the node uses) for ops with that
option, keywords read from the graph (`graph`), and the inputs ORT updates in place
(`in_place`), whose new values go through `ctx.update` so `Program.run_with_updates` returns
them."""
from __future__ import annotations

from typing import Callable

from jaxops.onnx import registry
from jaxops.onnx.registry import canonical_domain


def _table():
    """ORT_OPS under canonical domains."""
    from jaxops.ops import ORT_OPS  # late: the op families load jax kernels

    return {(canonical_domain(d), op): fn for (d, op), fn in ORT_OPS.items()}


def _adapter(fn: Callable) -> Callable:
    """The node handler of a spec'd op: `outputs=` from the outputs the graph uses, the
    spec's graph keywords, and its in-place inputs reported through ctx.update."""
    spec = fn.spec

    def run(ctx, *inputs, **attrs):
        if "outputs" in spec.options:
            attrs["outputs"] = tuple(ctx.output_used(i) for i in range(len(spec.outputs)))
        if spec.graph is not None:
            attrs.update(spec.graph(ctx, *inputs))
        out = fn(*inputs, **attrs)
        results = out if isinstance(out, tuple) else (out,)
        for i, k in spec.in_place.items():
            if k < len(results):
                ctx.update(i, results[k])
        if isinstance(out, tuple) and len(out) > ctx.num_outputs:
            out = out[:ctx.num_outputs]  # the graph uses only the leading outputs
        return out
    run.__name__ = run.__qualname__ = f"ort_{spec.name}"
    run.__doc__ = fn.__doc__
    return run


def ort_handler(domain: str, op_type: str) -> Callable | None:
    """The adapter for ORT_OPS[(domain, op_type)], or None; ONNX-domain entries (e.g.
    SoftmaxCrossEntropyLoss) are consulted only where no ai.onnx handler exists."""
    fn = _TABLE.get((canonical_domain(domain), op_type))
    return _adapter(fn) if fn is not None else None


def ort_keys():
    return list(_TABLE)


# Every other domain registers through the registry, so the census and `registered()` list it.
_TABLE = _table()
for (_domain, _op), _fn in sorted(_TABLE.items()):
    if _domain:
        registry.handler(_op, since=1, domain=_domain)(_adapter(_fn))
