"""View, PadAndUnflatten, FlattenAndUnpad (jit, vmap, vmap of grad and check_grads of the
padding ops: their matrix rows in tests/test_op_matrix.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import op_matrix as matrix
from jaxops import ops
from helpers import DTYPE_IDS, FLOAT_DTYPES


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,shapes", [((12,), [(3, 4)]), ((2, 6), [(2,), (5, 2), (0,)]),
                                          ((3, 4, 2), [(4, 1), [20]]), ((0,), [(0, 3)])])
def test_view(rng, dtype, shape, shapes):
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    shapes = [np.array(s, np.int64) for s in shapes]
    outs = ops.view(x, *shapes)
    flat, offset = np.asarray(x).ravel(), 0
    assert isinstance(outs, tuple) and len(outs) == len(shapes)
    for out, s in zip(outs, shapes):
        n = int(np.prod(s))
        assert out.dtype == dtype and out.shape == tuple(s)
        np.testing.assert_array_equal(np.asarray(out), flat[offset:offset + n].reshape(s))
        offset += n


def _padding_case(rng, dtype, rows, m1, m2, tail, index_dtype):
    x = jnp.asarray(rng.standard_normal((rows,) + tail), dtype)
    idx = rng.choice(m1 * m2, size=rows, replace=False).astype(index_dtype)
    return x, jnp.asarray(idx)


LAYOUTS = [(5, 2, 4, (3,)), (3, 3, 1, ()), (0, 2, 2, (2, 2)), (6, 2, 3, (1, 4))]
PADDING = ([(jnp.float32, np.int64, c) for c in LAYOUTS] +
           [(d, i, LAYOUTS[0]) for d in FLOAT_DTYPES[1:] for i in (np.int32, np.int64)])


@pytest.mark.parametrize("dtype,index_dtype,layout", PADDING,
                         ids=[f"{np.dtype(d).name}-{np.dtype(i).name}-{c}" for d, i, c in PADDING])
def test_pad_and_flatten(rng, dtype, index_dtype, layout):
    rows, m1, m2, tail = layout
    x, idx = _padding_case(rng, dtype, rows, m1, m2, tail, index_dtype)
    padded = ops.pad_and_unflatten(x, idx, np.array([m1, m2], index_dtype))
    expected = np.zeros((m1 * m2,) + tail, np.asarray(x).dtype)
    expected[np.asarray(idx)] = np.asarray(x)
    assert padded.dtype == dtype and padded.shape == (m1, m2) + tail
    np.testing.assert_array_equal(np.asarray(padded), expected.reshape((m1, m2) + tail))
    # FlattenAndUnpad undoes it and hands back [M1, M2] (static, in the indices' dtype)
    rows_back, dims = ops.flatten_and_unpad(padded, idx)
    assert rows_back.dtype == dtype and rows_back.shape == x.shape
    np.testing.assert_array_equal(np.asarray(rows_back), np.asarray(x))
    assert isinstance(dims, np.ndarray) and dims.dtype == index_dtype
    np.testing.assert_array_equal(dims, [m1, m2])
    # and the static dims feed PadAndUnflatten under jit
    jitted = jax.jit(lambda p, i: ops.pad_and_unflatten(*ops.flatten_and_unpad(p, i)[:1], i,
                                                        ops.flatten_and_unpad(p, i)[1]))
    np.testing.assert_array_equal(np.asarray(jitted(padded, idx)), np.asarray(padded))


def test_out_of_range_indices(rng):
    x = jnp.asarray(rng.standard_normal((4, 2)))
    idx = jnp.asarray([0, 6, -1, 2])  # 6 and -1 are outside [0, 6): dropped, never wrapped
    padded = ops.pad_and_unflatten(x, idx, (2, 3))
    expected = np.zeros((6, 2))
    expected[0], expected[2] = x[0], x[3]
    np.testing.assert_array_equal(np.asarray(padded).reshape(6, 2), expected)
    rows, _ = ops.flatten_and_unpad(padded, idx)  # out-of-range rows read as zeros
    np.testing.assert_array_equal(rows[1], 0)
    np.testing.assert_array_equal(rows[2], 0)
    np.testing.assert_array_equal(rows[3], x[3])


def test_grads(rng):
    """What the matrix rows leave out (tests/test_op_matrix.py has pad_and_unflatten's
    check_grads, vmap and vmap of grad): flatten_and_unpad's gradient (its row has none, as
    check_grads cannot take the int unflatten_dims output), View's, and the two ops being
    each other's transposes."""
    def rows(p, i):
        return ops.flatten_and_unpad(p, i)[0]

    make = ops.flatten_and_unpad.spec.matrix.make
    matrix.check_grads_order2(rng, rows, make, (0,), (2, 3))
    matrix.check_vmap_of_grad(rng, rows, make, (0,), (2, 3))
    x = jnp.asarray(rng.standard_normal((3, 4)))
    idx = jnp.asarray([4, 0, 2])
    np.testing.assert_array_equal(jax.grad(lambda x: ops.view(x, (2, 2), (8,))[1][3])(x),
                                  np.eye(12)[7].reshape(3, 4))
    # the gradient of PadAndUnflatten is FlattenAndUnpad of the cotangent
    ct = jnp.asarray(rng.standard_normal((2, 3, 4)))
    _, vjp = jax.vjp(lambda x: ops.pad_and_unflatten(x, idx, (2, 3)), x)
    np.testing.assert_array_equal(vjp(ct)[0], ops.flatten_and_unpad(ct, idx)[0])


def test_view_vmap_and_jit(rng):
    """View has no matrix row (its shapes are variadic static inputs)."""
    x = jnp.asarray(rng.standard_normal((5, 3, 2)))
    views = jax.vmap(lambda x: ops.view(x, (2,), (2, 2)))(x)
    np.testing.assert_array_equal(views[1], x.reshape(5, 6)[:, 2:].reshape(5, 2, 2))
    jitted = jax.jit(lambda x: ops.view(x, (6,), (3, 8)))(x)
    for got, want in zip(jitted, ops.view(x, (6,), (3, 8))):
        np.testing.assert_array_equal(got, want)
    g = jax.vmap(jax.grad(lambda x: jnp.sum(ops.view(x, (2,), (4,))[1] ** 2)))(x)
    np.testing.assert_array_equal(g, 2 * x.reshape(5, 6).at[:, :2].set(0).reshape(5, 3, 2))


def test_bad_input():
    f32 = jnp.ones((3, 2), jnp.float32)
    idx = jnp.asarray([0, 1, 2])
    cases = [
        (ops.view, (jnp.ones(4, jnp.int32), (4,)), TypeError, "input must be float"),
        (ops.view, (f32, (4,)), ValueError, "hold 4 elements in all, the input 6"),
        (ops.view, (f32, (7, -1)), ValueError, "dims >= 0"),
        (ops.view, (f32,), ValueError, "at least one shape"),
        (ops.view, (f32, [[6]]), TypeError, "1-D sequence of ints"),
        (ops.pad_and_unflatten, (f32, idx.astype(jnp.float32), (2, 2)), TypeError, "int32 or int64"),
        (ops.pad_and_unflatten, (f32, idx[:2], (2, 2)), ValueError, "one entry per input row"),
        (ops.pad_and_unflatten, (f32, idx, (4,)), ValueError, r"\[M1, M2\]"),
        (ops.pad_and_unflatten, (f32, idx[None], (2, 2)), ValueError, "1-D"),
        (ops.pad_and_unflatten, (jnp.ones(3, jnp.int8), idx, (2, 2)), TypeError, "float"),
        (ops.flatten_and_unpad, (jnp.ones(3), idx), ValueError, "rank >= 2"),
        (ops.flatten_and_unpad, (f32[None], idx.astype(jnp.uint8)), TypeError, "int32 or int64"),
    ]
    for fn, args, error, text in cases:
        with pytest.raises(error, match=text) as info:
            fn(*args)
        assert f"jaxops.ops.{fn.__name__}" in str(info.value)
    # shapes are static: traced ones are refused by name
    with pytest.raises(TypeError, match="unflatten_dims must be static") as info:
        jax.jit(lambda d: ops.pad_and_unflatten(f32, idx, d))(jnp.asarray([2, 2]))
    assert "jaxops.ops.pad_and_unflatten" in str(info.value)
    with pytest.raises(TypeError, match=r"shapes\[0\] must be static"):
        jax.jit(lambda s: ops.view(f32, s))(jnp.asarray([6]))


def test_ort_ops_table():
    ms = "com.microsoft"
    assert ops.ORT_OPS[(ms, "View")] is ops.view
    assert ops.ORT_OPS[(ms, "PadAndUnflatten")] is ops.pad_and_unflatten
    assert ops.ORT_OPS[(ms, "FlattenAndUnpad")] is ops.flatten_and_unpad
