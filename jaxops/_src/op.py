"""A kernel as a JAX primitive.

An `Op` is one kernel-backed op as a JAX primitive (a public op's spec, jaxops/_src/spec.py,
names it with `op=`). It holds the op's shape rule, pure-JAX reference, batch rule, sharding
description and differentiation rules, and registers them with JAX:

    user call --> the spec's function (argument checks; JAXOPS_DISABLE -> reference)
              --> Op.bind, or Op.__call__ for jaxops.nn's direct calls
              --> outer primitive (abstract eval, batch, jvp, transpose rules)
              --> lowered through custom_partitioning (the Shardy rule + partitioner)
              --> inner primitive --> FFI target on 'cpu' or 'cuda'

The two primitives keep vmap and autodiff above custom_partitioning, which supports neither.
An op without an FFI target is lowered from its `impl` as ordinary XLA code.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxops._src.compat import (Primitive, ShapedArray, ad, batching, custom_partitioning,
                                mlir, needs_devices_when_lowered, spans_devices)
from jaxops._src.disable import disabled
from jaxops._src.ffi import available_platforms


@dataclasses.dataclass(frozen=True)
class Factors:
    """How an op's dims map to each other, for sharding. One factor name per dim of each
    operand and result; dims sharing a name are sharded alike. `replicated` factors (the
    dims an op reduces over) are never sharded: a kernel needs them whole."""

    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    replicated: tuple[str, ...] = ()
    # Factors an op sums over into the results that lack them (a column sum over rows): a
    # shard computes partial sums, which are psum'd over the factor's mesh axes.
    summed: tuple[str, ...] = ()

    def rule(self):
        """The Shardy rule: an einsum-like string and its need-replication factors."""
        sides = [", ".join(" ".join(d) for d in dims) for dims in (self.operands, self.results)]
        return " -> ".join(sides), {"need_replication_factors": tuple(self.replicated)}

    def shardings(self, mesh, operand_shardings):
        """Operand and result shardings: each factor takes the first mesh axes an operand
        gives it, unless it must stay replicated or those axes are taken."""
        assigned = self._assign(operand_shardings)

        def sharding_of(dims):
            return NamedSharding(mesh, PartitionSpec(*(assigned.get(f) for f in dims)))

        return [sharding_of(d) for d in self.operands], [sharding_of(d) for d in self.results]

    def psum_axes(self, operand_shardings):
        """Per result, the mesh axes its partial sums must be psum'd over (empty: none)."""
        assigned = self._assign(operand_shardings)
        out = []
        for dims in self.results:
            axes = []
            for f in self.summed:
                if f in assigned and f not in dims:
                    a = assigned[f]
                    axes += list(a) if isinstance(a, tuple) else [a]
            out.append(tuple(axes))
        return out

    def _assign(self, operand_shardings):
        assigned: dict[str, Any] = {}
        used: set = set()
        for dims, sharding in zip(self.operands, operand_shardings):
            spec = tuple(getattr(sharding, "spec", ()))
            for factor, axes in zip(dims, spec + (None,) * (len(dims) - len(spec))):
                names = set(axes if isinstance(axes, tuple) else (axes,)) - {None}
                if not names or factor in self.replicated or factor in assigned or names & used:
                    continue
                assigned[factor] = axes
                used |= names
        return assigned


def _as_struct(out):
    return tuple(out) if isinstance(out, (tuple, list)) else out


def _to_aval(s):
    return ShapedArray(s.shape, s.dtype)


class Op:
    """One op. Rules take the op's params as keyword arguments:

    shape(*args, **params) -> ShapeDtypeStruct or a tuple of them; raises TypeError or
        ValueError for bad input (args carry .shape, .dtype and .ndim only).
    reference(*args, **params): the pure-JAX definition: test oracle and fallback.
    batch(op, args, dims, **params) -> (outputs, output batch dims).
    target / ffi_attrs(*args, **params) -> dict: the FFI target and its attributes
        (numpy-typed: a Python int or float would arrive with the wrong width; a tuple of
        ints arrives as an int64 array).
    impl(*args, **params): XLA lowering, for an op without an FFI target.
    factors(*args, **params) -> Factors, for sharding (FFI ops only).
    jvp(op, primals, tangents, **params) -> (out, tangent): default differentiates the
        reference, so every op has gradients of any order.
    transpose(op, ct, *args, **params): for ops linear in some operands.
    aliases(*args, **params) -> {operand index: result index}: results that reuse an
        operand's buffer (ORT's in-place updates), so a donated operand is updated in place
        (FFI ops only; XLA copies an operand that is not donated).
    xla_when(platform, *args, **params) -> bool: where XLA's own code for the reference is
        measured faster than the kernel (docs/performance.md), the op lowers the reference
        there instead of calling the kernel.
    """

    def __init__(self, name: str, *, shape: Callable, reference: Callable, batch: Callable,
                 target: str | None = None, ffi_attrs: Callable | None = None,
                 factors: Callable | None = None, impl: Callable | None = None,
                 jvp: Callable | None = None, transpose: Callable | None = None,
                 multiple_results: bool = False, aliases: Callable | None = None,
                 xla_when: Callable | None = None):
        self.name = name
        self.reference = reference
        self._shape = shape
        self._multiple = multiple_results

        self.primitive = Primitive(f"jaxops_{name}")
        self.primitive.multiple_results = multiple_results
        self.primitive.def_impl(self._eager)
        self.primitive.def_abstract_eval(self._abstract_eval)
        batching.primitive_batchers[self.primitive] = functools.partial(batch, self)
        ad.primitive_jvps[self.primitive] = functools.partial(jvp or _jvp_of_reference, self)
        if transpose is not None:
            ad.primitive_transposes[self.primitive] = functools.partial(transpose, self)

        if target is None:
            mlir.register_lowering(self.primitive,
                                   mlir.lower_fun(impl, multiple_results=multiple_results))
            return
        kernel = self._ffi_lowering(target, ffi_attrs, factors, aliases)
        needs_devices_when_lowered(self.primitive)
        if xla_when is None:
            mlir.register_lowering(self.primitive, kernel)
            return
        xla = mlir.lower_fun(reference, multiple_results=multiple_results)
        for platform in available_platforms():
            mlir.register_lowering(self.primitive, _routed(platform, xla_when, kernel, xla),
                                   platform=platform)

    def __call__(self, *args, **params):
        args = [None if a is None else jnp.asarray(a) for a in args]
        self.check(*args, **params)  # errors now, also on the reference path
        if disabled(self.name):
            return self.reference(*args, **params)
        return self.bind(*args, **params)

    def bind(self, *args, **params):
        """The kernel path, without validation or the JAXOPS_DISABLE switch (for rules)."""
        out = self.primitive.bind(*args, **params)
        return tuple(out) if self._multiple else out

    def _eager(self, *args, **params):
        # Op-by-op execution through jit (jax's own op-by-op path gives custom_partitioning
        # no device assignment).
        return _jitted(self.primitive, tuple(sorted(params.items())))(*args)

    def check(self, *args, **params):
        try:
            return _as_struct(self._shape(*args, **params))
        except (TypeError, ValueError) as e:
            raise type(e)(f"jaxops.ops.{self.name}: {e}") from None

    def _abstract_eval(self, *avals, **params):
        out = self.check(*avals, **params)
        return [_to_aval(s) for s in out] if self._multiple else _to_aval(out)

    def _ffi_lowering(self, target, ffi_attrs, factors, aliases):
        inner = Primitive(f"jaxops_{self.name}_ffi")
        inner.multiple_results = self._multiple
        # The inner primitive carries the op's params (its shapes may depend on params the
        # kernel does not take) and `_aliases` (operand -> result pairs) beside the kernel's
        # attributes; neither reaches the kernel.
        inner.def_abstract_eval(lambda *avals, op_params, _aliases=(), **attrs:
                                self._abstract_eval(*avals, **dict(op_params)))

        def lower_inner(ctx, *args, op_params, _aliases=(), **attrs):
            rule = jax.ffi.ffi_lowering(target, operand_output_aliases=dict(_aliases) or None)
            # (a tuple travels the jaxpr hashable; the kernel reads an int64 array)
            attrs = {k: np.array(v, np.int64) if isinstance(v, tuple) else v
                     for k, v in attrs.items()}
            return rule(ctx, *args, **attrs)

        for platform in available_platforms():
            mlir.register_lowering(inner, lower_inner, platform=platform)

        def call_kernel(args, frozen_params):
            params = dict(frozen_params)
            pairs = tuple(sorted(aliases(*args, **params).items())) if aliases else ()
            return inner.bind(*args, op_params=frozen_params, _aliases=pairs,
                              **ffi_attrs(*args, **params))

        # custom_partitioning passes shapes in the pytree of call_kernel's dynamic args: (args,)
        def partition(frozen_params, mesh, arg_shapes, result_shape):
            (arg_shapes,) = arg_shapes
            f = factors(*arg_shapes, **dict(frozen_params))
            arg_shardings, result_shardings = f.shardings(mesh, [a.sharding for a in arg_shapes])
            results = result_shardings if self._multiple else result_shardings[0]
            psums = f.psum_axes([a.sharding for a in arg_shapes])

            def lower(args):
                out = call_kernel(args, frozen_params)
                if not any(psums):
                    return out
                outs = [jax.lax.psum(o, ax) if ax else o
                        for o, ax in zip(out if self._multiple else [out], psums)]
                return outs if self._multiple else outs[0]
            return mesh, lower, results, (tuple(arg_shardings),)

        def infer(frozen_params, mesh, arg_shapes, result_shape):
            (arg_shapes,) = arg_shapes
            f = factors(*arg_shapes, **dict(frozen_params))
            _, result_shardings = f.shardings(mesh, [a.sharding for a in arg_shapes])
            return result_shardings if self._multiple else result_shardings[0]

        def rule(frozen_params, mesh, operand_types, result_types):
            structs = [jax.ShapeDtypeStruct(tuple(t.shape), jnp.float32) for t in operand_types]
            return factors(*structs, **dict(frozen_params)).rule()

        partitioned = custom_partitioning(call_kernel, static_argnums=(1,))
        partitioned.def_partition(partition=partition, infer_sharding_from_operands=infer,
                                  sharding_rule=rule)

        def lowering(ctx, *args, **params):
            fn = partitioned if spans_devices(ctx) else call_kernel
            lower = lambda *a: fn(tuple(a), tuple(sorted(params.items())))
            return mlir.lower_fun(lower, multiple_results=self._multiple)(ctx, *args)

        return lowering


def _routed(platform, xla_when, kernel, xla):
    """The lowering on `platform`: the reference's XLA code where xla_when says it wins."""
    def lowering(ctx, *args, **params):
        use_xla = xla_when(platform, *ctx.avals_in, **params)
        return (xla if use_xla else kernel)(ctx, *args, **params)
    return lowering


@functools.cache
def _jitted(primitive, frozen_params):
    return jax.jit(functools.partial(primitive.bind, **dict(frozen_params)))


def _jvp_of_reference(op, primals, tangents, **params):
    out = op.bind(*primals, **params)
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    _, tangent_out = jax.jvp(functools.partial(op.reference, **params), tuple(primals), tangents)
    return out, tangent_out


def batch_at_front(args: Sequence, dims: Sequence):
    """Moves every operand's batch dim to the front; unbatched operands are broadcast."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    return [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
            for a, d in zip(args, dims)]


def is_zero(t) -> bool:
    """True for a symbolic-zero tangent or cotangent."""
    return type(t) is ad.Zero


def is_undefined(x) -> bool:
    """True for the linear operand a transpose rule solves for."""
    return ad.is_undefined_primal(x)


def shape_of(x) -> tuple[int, ...]:
    """The shape of a transpose rule's operand, solved for (is_undefined) or not."""
    return tuple(x.aval.shape if is_undefined(x) else x.shape)
