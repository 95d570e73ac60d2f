"""Parameters, gradients and moments kept in one flat buffer per dtype, as ORT keeps them.

The ORT-API mirror (`jaxops.onnx.training`) calls a jitted step per `module(...)` and per
`optimizer.step()`. Handing a jitted call hundreds of buffers (GPT-2 small: 148 parameters,
their gradients and two moments each) costs about a millisecond of host time a call, as long as
the optimizer's whole update takes on an H100. Packed, the optimizer step gets four buffers per
dtype and updates them as one tensor (AdamW and SGD are elementwise: the same bits), and the
train step slices its parameters out of the flat buffer inside the jitted function.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxops.ops.ranges import take_ranges


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each named array sits in the flat buffer of its dtype.

    groups: ((dtype name, ((name, shape, offset), ...)), ...) in the order the names came
      (a tuple, so that it hashes: it is static under jit).
    """
    groups: tuple[tuple[str, tuple[tuple[str, tuple[int, ...], int], ...]], ...]

    @classmethod
    def of(cls, arrays: dict[str, Any]) -> Layout:
        groups: dict[str, list] = {}
        ends: dict[str, int] = {}
        for name, x in arrays.items():
            key, shape = np.dtype(x.dtype).name, tuple(x.shape)
            offset = ends.get(key, 0)
            groups.setdefault(key, []).append((name, shape, offset))
            ends[key] = offset + math.prod(shape)
        return cls(tuple((k, tuple(v)) for k, v in groups.items()))

    @property
    def names(self) -> list[str]:
        return [name for _, group in self.groups for name, _, _ in group]

    def pack(self, arrays: dict[str, Any]) -> dict[str, jax.Array]:
        """The flat buffer of each dtype (a concatenation: inside jit one fused copy)."""
        return {key: jnp.concatenate([jnp.ravel(arrays[name]) for name, _, _ in group])
                for key, group in self.groups}

    def unpack(self, flat: dict[str, jax.Array],
               taken: frozenset[str] = frozenset()) -> dict[str, jax.Array]:
        """The named arrays, sliced out of the flat buffers; those named in `taken` by one
        take_ranges call a dtype (jaxops/ops/ranges.py: one thunk on XLA:CPU, not one each)."""
        out = {}
        for key, group in self.groups:
            picked = [(name, (offset, shape)) for name, shape, offset in group if name in taken]
            if len(picked) > 1:
                out.update(zip((n for n, _ in picked),
                               take_ranges(flat[key], [p for _, p in picked])))
            for name, shape, offset in group:
                if name not in out:
                    out[name] = flat[key][offset:offset + math.prod(shape)].reshape(shape)
        return {name: out[name] for name in self.names}


_BUFFERS = ("trained", "grads", "moments", "other_moments", "rest", "step")
_FIELDS = frozenset(_BUFFERS) | {"layout", "rest_layout", "order"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedState:
    """A TrainState (train_core's) with its arrays packed by `Layout`s, which are static.

    trained: the parameters a training model trains (`layout`); `grads` and each of `moments`
      share that layout, so an elementwise optimizer updates the buffers as they are.
    rest: the other parameters, trainable or frozen (`rest_layout`).
    other_moments: moments kept by name, unpacked: those of parameters not trained here, or all
      of them while some trained parameter has none yet (before the optimizer's init).
    order: the TrainState's parameter and frozen names, and the trained ones, in order.
    """
    trained: dict[str, Any]
    grads: dict[str, Any]
    moments: dict[str, dict[str, Any]]
    other_moments: dict[str, dict[str, Any]]
    rest: dict[str, Any]
    step: Any
    layout: Layout = dataclasses.field(metadata=dict(static=True))
    rest_layout: Layout = dataclasses.field(metadata=dict(static=True))
    order: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = dataclasses.field(
        metadata=dict(static=True))

    @classmethod
    def pack(cls, state, trained: list[str]) -> PackedState:
        """Packs a TrainState whose gradients are those of `trained` (the training model's)."""
        layout = Layout.of({n: state.params[n] for n in trained})
        rest = {n: state.param(n) for n in (*state.params, *state.frozen) if n not in trained}
        rest_layout = Layout.of(rest)
        keys = {tuple(state.moments[n]) if n in state.moments else () for n in trained}
        moments, other = {}, dict(state.moments)
        if trained and len(keys) == 1 and keys != {()}:
            moments = {k: layout.pack({n: state.moments[n][k] for n in trained})
                       for k in next(iter(keys))}
            other = {n: m for n, m in state.moments.items() if n not in layout.names}
        return cls(trained=layout.pack(state.params), grads=layout.pack(state.grads),
                   moments=moments, other_moments=other, rest=rest_layout.pack(rest),
                   step=state.step, layout=layout, rest_layout=rest_layout,
                   order=(tuple(state.params), tuple(state.frozen), tuple(trained)))

    @property
    def trained_names(self) -> tuple[str, ...]:
        return self.order[2]

    @property
    def static(self) -> tuple[Layout, Layout, tuple]:
        """The layouts and names, hashable: with `buffers`, what a jitted function takes
        instead of the PackedState (`from_buffers` rebuilds it inside). A jitted call given
        dicts of arrays dispatched 10-16 us faster than one given this dataclass (gpt2_ts's
        eval step on one CPU core, 2026-11-24)."""
        return self.layout, self.rest_layout, self.order

    @property
    def buffers(self) -> dict[str, Any]:
        """The arrays: {trained, grads, moments, other_moments, rest, step}."""
        return {f: getattr(self, f) for f in _BUFFERS}

    @classmethod
    def from_buffers(cls, static, **buffers) -> PackedState:
        """The PackedState of `static` (`.static`) and `buffers` (`.buffers`; those left
        out are empty, the step None)."""
        layout, rest_layout, order = static
        fields = {f: buffers.pop(f, None if f == "step" else {}) for f in _BUFFERS}
        if buffers:
            raise TypeError(f"not buffers of a PackedState: {sorted(buffers)}")
        return cls(**fields, layout=layout, rest_layout=rest_layout, order=order)

    def replace(self, **changes) -> PackedState:
        """A copy with `changes`: a dict update, as each step makes one (1.2-1.5 us;
        dataclasses.replace 3.9 us, measured under load on 2026-11-24)."""
        if not _FIELDS.issuperset(changes):  # (no set made where all are fields)
            raise TypeError(f"not fields of a PackedState: {sorted(changes.keys() - _FIELDS)}")
        new = object.__new__(PackedState)
        new.__dict__.update(self.__dict__, **changes)
        return new

    def unpack(self, taken: frozenset[str] = frozenset()):
        """The TrainState these buffers hold, its arrays slices of them (no gradients where
        the grads were left out: the eval step's); the parameters named in `taken` come out
        of their buffers by one kernel call a dtype (Layout.unpack)."""
        from jaxops.onnx.train_core import TrainState

        arrays = {**self.layout.unpack(self.trained, taken),
                  **self.rest_layout.unpack(self.rest, taken)}
        params_order, frozen_order, _ = self.order
        per_key = {k: self.layout.unpack(m) for k, m in self.moments.items()}
        moments = {n: {k: per_key[k][n] for k in per_key} for n in self.layout.names
                   } if per_key else {}
        return TrainState(params={n: arrays[n] for n in params_order},
                          frozen={n: arrays[n] for n in frozen_order},
                          grads=self.layout.unpack(self.grads) if self.grads else {},
                          moments={**self.other_moments, **moments}, step=self.step)


__all__ = ["Layout", "PackedState"]
