"""The one place that touches jax internals, so a jax upgrade is fixed here only.

Supported: jax >= 0.8 (checked on 0.8.0 and 0.12.x).
"""
import jax
from jax._src.core import ShapedArray
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["Primitive", "ShapedArray", "ad", "backends_started", "batching", "custom_partitioning",
           "mark_varying", "mlir",
           "needs_devices_when_lowered", "spans_devices", "varying_axes"]


def needs_devices_when_lowered(primitive) -> None:
    """Makes jit hand the device assignment to `primitive`'s lowering, which custom
    partitioning needs (jit only does that for primitives it knows need it)."""
    from jax._src import dispatch

    dispatch.prim_requires_devices_during_lowering.add(primitive)


def spans_devices(ctx) -> bool:
    """Whether a lowering runs over several known devices, so custom_partitioning can act.
    With one device, or none assigned yet (eager calls), it would fail or do nothing."""
    from jax._src.sharding_impls import ShardingContext

    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, ShardingContext):
        return axis_context.num_devices > 1 and axis_context.device_assignment is not None
    return True


def varying_axes(x) -> frozenset:
    """The mesh axes a value inside shard_map varies over (its 'vma' type; jax 0.12 keeps it
    in manual_axis_type.varying)."""
    import jax

    aval = jax.typeof(x)
    if hasattr(aval, "manual_axis_type"):
        return frozenset(aval.manual_axis_type.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def mark_varying(x, axes):
    """Casts a value that is the same on every rank of `axes` to one typed as varying over
    them (lax.pvary in jax 0.8, lax.pcast(to='varying') later)."""
    from jax import lax

    axes = tuple(axes)
    if not axes:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)


def backends_started() -> bool:
    """Whether jax has created its backends (its CPU client among them): settings read at
    their creation (jax_cpu_enable_async_dispatch, PJRT_NPROC) no longer take effect."""
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def jax_release_in(releases) -> bool:
    """Whether this jax's (major, minor) lies in [releases[0], releases[1])."""
    return releases[0] <= jax.__version_info__[:2] < releases[1]
