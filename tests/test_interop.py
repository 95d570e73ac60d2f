"""Pipeline ordering ops and the refusal of model-named code."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxops import ops


@pytest.mark.parametrize("op", [ops.record_event, ops.wait_event])
def test_events_pass_inputs_through_a_barrier(rng, op):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    y = rng.integers(0, 9, 5)
    a, b = jax.jit(lambda x, y: op(np.int64(7), x * 2, y))(x, y)
    np.testing.assert_array_equal(a, x * 2)
    np.testing.assert_array_equal(b, y)
    hlo = jax.jit(lambda x: op(np.int64(1), x)).lower(x).as_text()
    assert "optimization_barrier" in hlo
    check_grads(lambda x: op(np.int64(1), jnp.sin(x)) * 3, (x.astype(np.float64),), order=2)
    batched = jax.vmap(lambda x: op(np.int64(1), x))(x)
    np.testing.assert_array_equal(batched, x)


def test_event_id_checked():
    with pytest.raises(TypeError, match="record_event: event_id must be int32 or int64"):
        ops.record_event(np.float32(1), jnp.ones(2))
    with pytest.raises(ValueError, match="wait_event: event_id .*must hold one value"):
        ops.wait_event(np.arange(2), jnp.ones(2))


@pytest.mark.parametrize("op", [ops.python_op, ops.triton_op])
def test_model_named_code_is_refused_unless_registered(op):
    with pytest.raises(ValueError, match="refusing to run 'os.system'"):
        op(jnp.ones(2), func_name="os.system")
    with pytest.raises(ValueError, match="names no function"):
        op(jnp.ones(2))


def test_registered_python_function_runs():
    ops.register_python_function("mine.Double", lambda x, **attrs: 2 * x)
    ops.register_python_function("mine.DoubleBackward", lambda g, **attrs: 2 * g)
    try:
        ctx, y = ops.python_op(jnp.arange(3.0), func_name="mine.Double", inplace=0)
        assert ctx.dtype == jnp.int64
        np.testing.assert_array_equal(y, [0, 2, 4])
        np.testing.assert_array_equal(
            ops.python_op_grad(ctx, jnp.ones(3), func_name="mine.DoubleBackward"), [2, 2, 2])
    finally:
        ops.register_python_function("mine.Double", None)
        ops.register_python_function("mine.DoubleBackward", None)
    with pytest.raises(ValueError, match="refusing"):
        ops.python_op(jnp.ones(2), func_name="mine.Double")
    with pytest.raises(TypeError, match="needs a callable"):
        ops.register_python_function("x", 3)


def test_yield_op():
    with pytest.raises(ValueError, match="gradient_fn"):
        ops.yield_op(jnp.ones(2), full_shape_outputs=[0])
    g = ops.yield_op(jnp.ones(2), jnp.arange(3), non_differentiable_outputs=[1],
                     full_shape_outputs=[0], gradient_fn=lambda y: -y)
    np.testing.assert_array_equal(g, [-1, -1])
    with pytest.raises(ValueError, match="returned 2 gradients for 1"):
        ops.yield_op(jnp.ones(2), gradient_fn=lambda y: (y, y))
