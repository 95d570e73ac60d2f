"""Gradient-control and barrier ops (com.microsoft): ZeroGradient, InPlaceAccumulator,
InPlaceAccumulatorV2, Group, PassThrough.

All are XLA code (jaxops.reference.control), not kernels: they are elementwise or no-ops, so
XLA fuses them into the ops that produce their inputs, which an FFI call (a fusion barrier)
would prevent, and a kernel could at best match XLA's bandwidth.

ORT updates buffers in place; here results are returned. An accumulator's output has its
buffer's shape and dtype, so under `jax.jit(..., donate_argnums=...)` with the buffer donated
XLA writes the result into the donated buffer (no copy); called eagerly, a new array is made.

Accumulating a value whose shape the buffer's shape broadcasts to (e.g. a value of [1,1,4,4]
into a scalar buffer) sums the value over the broadcast dims first. ORT's gradient builder
writes such graphs when a forward op broadcasts a parameter and the builder leaves out the
reduction (a scalar under Where, in BERT exported by torch's dynamo exporter); the sum is the
true gradient. ORT 1.19.2 accepts the value and returns a wrong buffer there (0.0625 where the
gradient is 0.5, measured); a value that does not broadcast that way is an error.
"""
import jax.numpy as jnp
import numpy as np

from jaxops._src import rules
from jaxops._src.spec import Matrix, define
from jaxops.reference import control as ref

_MS = "com.microsoft"


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _flag(rng):
    return jnp.asarray([rng.uniform() < 0.5])


zero_gradient = define(
    "zero_gradient", ort=(_MS, "ZeroGradient"), inputs=("old_gradient: float", "reset_signal"),
    outputs=("zero_gradient",), in_place={0: 0}, reference=ref.zero_gradient,
    doc="""ORT ZeroGradient: zeros shaped like old_gradient. reset_signal (any tensor) only
    orders the op in ORT's graph; JAX orders by data flow, so it is not used. XLA code: a
    constant fill that XLA fuses or folds.""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype), _flag(rng)),
                  grad=(0,), shard=False,
                  skip="the zeros are a constant fill that reads nothing of old_gradient: XLA "
                       "places them replicated (jax 0.12 has no shard_alike); "
                       "tests/test_control.py checks a sharded input is not gathered"))


def _broadcasts(shape, to) -> bool:
    try:
        return np.broadcast_shapes(shape, to) == tuple(to)
    except ValueError:
        return False


def _accumulate_check(names):
    """The accumulators' rule: value of the buffer's shape, or of one that shape broadcasts
    to; a flag of one bool element."""
    def check(buffer, value, flag):
        if buffer.shape != value.shape and not _broadcasts(buffer.shape, value.shape):
            raise ValueError(f"{names[1]} must have {names[0]}'s shape, or one that shape "
                             f"broadcasts to, got {buffer.shape} and {value.shape}")
        if flag is not None:
            rules.flag(names[2], flag)
    return check


def _accumulate_inputs(rng, shape, dtype):
    return _normal(rng, shape, dtype), _normal(rng, shape, dtype), _flag(rng)


in_place_accumulator = define(
    "in_place_accumulator", ort=(_MS, "InPlaceAccumulator"),
    inputs=("old_sum: float", "value: float", "update_signal?: bool"), outputs=("new_sum",),
    in_place={0: 0}, check=_accumulate_check(("old_sum", "value", "update_signal")),
    reference=ref.in_place_accumulator,
    doc="""ORT InPlaceAccumulator: new_sum = old_sum + value (value cast to old_sum's dtype), or
    old_sum unchanged when update_signal (bool, one element) is false. XLA code: one fused
    elementwise add (see the module docstring for in-place use).

    A value of a shape that old_sum's shape broadcasts to is first summed over the broadcast
    dims (module docstring: a deliberate difference from ORT 1.19.2).""",
    matrix=Matrix(_accumulate_inputs, grad=(0, 1)))

in_place_accumulator_v2 = define(
    "in_place_accumulator_v2", ort=(_MS, "InPlaceAccumulatorV2"),
    inputs=("accumulation_buffer: float", "value: float", "overwrite_flag?: bool"),
    outputs=("updated_flag", "accumulation_buffer_out"), in_place={0: 1},
    check=_accumulate_check(("accumulation_buffer", "value", "overwrite_flag")),
    reference=ref.in_place_accumulator_v2,
    doc="""ORT InPlaceAccumulatorV2: (updated_flag, accumulation_buffer_out).

    accumulation_buffer_out = value when overwrite_flag (bool, one element) is true, else
    accumulation_buffer + value (value cast to the buffer's dtype; absent flag: accumulate).
    updated_flag is bool [1], always true (ORT's shape). XLA code: one fused elementwise op;
    donate the buffer under jit to update it in place (module docstring).

    A value of a shape that the buffer's shape broadcasts to is first summed over the
    broadcast dims (module docstring: a deliberate difference from ORT 1.19.2).
    """,
    matrix=Matrix(_accumulate_inputs, grad=(0, 1), shard=False,
                  skip="the first output is ORT's bool [1] flag; tests/test_control.py checks "
                       "that the buffer stays sharded with no gather"))


def _need(*xs):
    if not xs:
        raise ValueError("needs at least one input")


group = define(
    "group", ort=(_MS, "Group"), inputs=("*input_tensors",), outputs=("done",), check=_need,
    reference=ref.group,
    doc="""ORT Group: a bool [1] true once every input is computed (ORT 1.19.2's shape; its
    schema says scalar). XLA code: an optimization barrier over the inputs and the flag.""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype),
                                             jnp.asarray(rng.integers(0, 9, shape), jnp.int32)),
                  shard=False, skip="the output is one bool [1]: nothing to shard"))

pass_through = define(
    "pass_through", ort=(_MS, "PassThrough"), inputs=("*inputs",), outputs=("*outputs",),
    check=_need, reference=ref.pass_through,
    doc="""ORT PassThrough: the inputs unchanged, as a tuple, through an XLA optimization
    barrier (a scheduling barrier, as in ORT's pipeline graphs; no copy).""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype),
                                             _normal(rng, shape[:1], dtype)), grad=(0, 1)))

__all__ = ["group", "in_place_accumulator", "in_place_accumulator_v2", "pass_through",
           "zero_gradient"]
