"""A public op, declared once.

`define(name, ort=..., inputs=..., outputs=..., attrs=..., ...)` returns the public function
`jaxops.ops.<name>` and attaches its `Spec`. Everything else reads the spec:

- the function itself: its signature (inputs positional in ORT's order, attributes and
  jaxops' options keywords), one argument checker (input kinds, then the op's own `check`),
  errors prefixed `jaxops.ops.<name>:`, and the JAXOPS_DISABLE switch (the reference runs);
- `jaxops.ops.ORT_OPS` (from `ort`);
- the importer's adapter (`in_place`, `graph`: jaxops/onnx/handlers/com_microsoft.py);
- the training core's optimizer layouts (`roles`: jaxops/onnx/train_core.py);
- the transformation checks every op gets (`matrix`: tests/test_op_matrix.py).

Input declarations are strings "name: kind", with "name?" for an optional input (None when
absent) and "*name" for a variadic one. Kinds:

    float   a float16/bfloat16/float32/float64 array
    index   an int32/int64 array
    bool    a bool array
    array   any array
    static  a 1-D sequence of ints read on the host (a shape, axes): a tuple of ints here
    any     passed as given (lists, keys, pytrees)

Host int64/uint64 values that 32 bits would change are refused while x64 is off (jax would
narrow them silently), except `static` inputs, which are read exactly as Python ints.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from jaxops._src import rules
from jaxops._src.disable import disabled

REQUIRED = inspect.Parameter.empty  # an attribute with no default


@dataclasses.dataclass(frozen=True)
class Input:
    name: str
    kind: str
    optional: bool = False
    variadic: bool = False

    @classmethod
    def parse(cls, text: str) -> Input:
        name, _, kind = (s.strip() for s in text.partition(":"))
        variadic, name = name.startswith("*"), name.lstrip("*")
        optional, name = name.endswith("?"), name.rstrip("?")
        kind = kind or "array"
        if kind not in _CONVERT:
            raise ValueError(f"input {name!r}: unknown kind {kind!r}")
        return cls(name, kind, optional, variadic)


@dataclasses.dataclass(frozen=True)
class Matrix:
    """The op's row in the transformation matrix (tests/test_op_matrix.py): jit, vmap with
    every in_axes pattern, vmap of grad, check_grads order 2, a dim-0-sharded input on 4
    devices that stays sharded with no all-gather.

    make(rng, shape, dtype) -> the positional inputs, fresh random, at a leading shape;
    attrs: the keywords the matrix calls the op with (attributes, and static inputs by name);
    grad: indices of the inputs to differentiate (empty: the op is not differentiable);
    shard: False where dim 0 cannot stay sharded (the reason goes in `skip`);
    vmap: False where the op has no batch rule (same);
    eps: check_grads' finite-difference step where jax's default is too coarse.
    """
    make: Callable
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    grad: tuple[int, ...] = ()
    shard: bool = True
    vmap: bool = True
    eps: float | None = None
    skip: str = ""


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    ort: tuple[str, str] | None
    inputs: tuple[Input, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any]
    options: Mapping[str, Any]
    reference: Callable
    kernel: Callable | None = None
    check: Callable | None = None
    in_place: Mapping[int, int] = dataclasses.field(default_factory=dict)
    graph: Callable | None = None
    roles: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    extra_attrs: bool = False
    matrix: Matrix | None = None
    no_matrix: str = ""

    @property
    def variadic(self) -> Input | None:
        return next((i for i in self.inputs if i.variadic), None)

    def input_index(self, name: str) -> int:
        return next(k for k, i in enumerate(self.inputs) if i.name == name)

    def signature(self) -> inspect.Signature:
        P = inspect.Parameter
        params = []
        for inp in self.inputs:
            if inp.variadic:
                params.append(P(inp.name, P.VAR_POSITIONAL))
            else:
                params.append(P(inp.name, P.POSITIONAL_OR_KEYWORD,
                                default=None if inp.optional else P.empty))
        for name, default in {**self.attrs, **self.options}.items():
            params.append(P(name, P.KEYWORD_ONLY, default=default))
        if self.extra_attrs:
            params.append(P("attributes", P.VAR_KEYWORD))
        return inspect.Signature(params)


def define(name: str, *, ort: tuple[str, str] | None, inputs, outputs=(), attrs=None,
           options=None, reference: Callable, kernel: Callable | None = None,
           check: Callable | None = None, op=None, params=None, doc: str = "",
           in_place=None, graph=None, roles=None, extra_attrs=False,
           matrix: Matrix | None = None, no_matrix: str = "") -> Callable:
    """The public function of one op (see the module's docstring), with `.spec` and
    `.reference`: the same call (the same checks) that always runs the pure-JAX definition,
    for callers that measured XLA's code faster than the kernel where they use it.

    reference(*inputs, **attrs, **options): the pure-JAX definition, run when the op is
      disabled (or always, when there is no kernel);
    kernel(...): the fast path, same call;
    check(...): the op's own argument rules beyond input kinds; it raises TypeError or
      ValueError, which come out prefixed with the op's name;
    op, params: a kernel-backed `Op` and the fixed params it is bound with: then the Op's
      shape rule is the check and Op.bind the kernel;
    in_place: {input index: output index} for inputs ORT updates in place;
    graph(ctx, *inputs) -> keywords the importer reads from the graph around a node (ctx:
      jaxops.onnx's NodeContext);
    roles: the training core's names for optimizer inputs;
    matrix / no_matrix: the op's transformation-matrix row, or why it has none.
    """
    if op is not None:
        fixed = dict(params or {})
        kernel = lambda *a, **kw: op.bind(*a, **kw, **fixed)
        check = check or (lambda *a, **kw: op.check(*a, **kw, **fixed))
    spec = Spec(name, ort, tuple(Input.parse(i) for i in inputs), tuple(outputs),
                dict(attrs or {}), dict(options or {}), reference, kernel, check,
                dict(in_place or {}), graph, dict(roles or {}), extra_attrs, matrix, no_matrix)
    if matrix is None and not no_matrix:
        raise ValueError(f"{name}: give a matrix row or say why there is none (no_matrix=)")
    return _public(spec, doc)


def _public(spec: Spec, doc: str) -> Callable:
    signature = spec.signature()
    label = f"jaxops.ops.{spec.name}"

    def invoke(args, kwargs, xla: bool):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{label}: {e}") from None
        bound.apply_defaults()
        values = bound.arguments
        with rules.named(spec.name):
            positional = []
            for inp in spec.inputs:
                if inp.variadic:
                    positional += [_convert(inp, v, f"{inp.name}[{k}]")
                                   for k, v in enumerate(values[inp.name])]
                else:
                    positional.append(_convert(inp, values[inp.name], inp.name))
            keywords = {k: values[k] for k in (*spec.attrs, *spec.options)}
            missing = [k for k, v in keywords.items() if v is REQUIRED]
            if missing:
                raise TypeError(f"missing required attribute(s) {', '.join(missing)}")
            keywords.update(values.get("attributes", {}))
            if spec.check is not None:
                spec.check(*positional, **keywords)
        xla = xla or spec.kernel is None or disabled(spec.name)
        return (spec.reference if xla else spec.kernel)(*positional, **keywords)

    def call(*args, **kwargs):
        return invoke(args, kwargs, False)

    def reference(*args, **kwargs):
        return invoke(args, kwargs, True)

    reference.__signature__ = signature
    call.reference = reference
    call.__name__ = call.__qualname__ = spec.name
    call.__doc__ = doc
    call.__signature__ = signature
    call.spec = spec
    return call


def _convert(inp: Input, value, label: str):
    if value is None:
        if inp.optional:
            return None
        raise TypeError(f"{label} is required (ORT does not make it optional)")
    if inp.kind != "static":
        rules.check_host_ints(label, value)
    return _CONVERT[inp.kind](value, label)


def _array(value, label):
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{label} must be an array, got {type(value).__name__}: {e}") from None


def _kind(dtypes, words):
    def convert(value, label):
        x = _array(value, label)
        if np.dtype(x.dtype) not in dtypes:
            raise TypeError(f"{label} must be {words}, got {x.dtype}")
        return x
    return convert


_CONVERT = {
    "float": _kind(rules.FLOATS, rules.FLOAT_WORDS),
    "index": _kind(rules.INDEX, "int32 or int64"),
    "bool": _kind((np.dtype(np.bool_),), "bool"),
    "array": _array,
    "static": rules.static_ints,
    "any": lambda value, label: value,
}


def specs(functions) -> dict[str, Spec]:
    """name -> Spec of the public functions among `functions` that have one."""
    return {f.spec.name: f.spec for f in functions if hasattr(f, "spec")}
