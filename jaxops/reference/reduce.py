"""Pure-JAX ReduceSumTraining, also its implementation (jaxops.ops.reduce validates)."""
import jax.numpy as jnp


def reduce_sum_training(data, axes, keepdims=1, noop_with_empty_axes=0):
    """ReduceSum-13 with static `axes` (a tuple): empty axes reduce everything, or nothing
    when noop_with_empty_axes. f16/bf16 accumulate in f32 and round once."""
    if not axes:
        if noop_with_empty_axes:
            return data
        axes = tuple(range(data.ndim))
    acc = jnp.float32 if data.dtype in (jnp.float16, jnp.bfloat16) else data.dtype
    out = jnp.sum(data, axis=tuple(axes), keepdims=bool(keepdims), dtype=acc)
    return out.astype(data.dtype)
