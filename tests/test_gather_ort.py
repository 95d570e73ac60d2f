"""The gather-gradient ops and SliceGrad against onnxruntime-training 1.19.2 itself (CPU).

ORT's CPU kernels raise on an out-of-range index, so these cases use in-range ones (negative
ones included: ORT wraps them too); jaxops' drop rule is tested in test_gather.py.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops
from helpers import assert_close

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")

FLOATS = [np.float32, np.float64, np.float16]  # what ORT 1.19.2 runs on CPU
INDEX = [np.int32, np.int64]


def check(got, expected, dtype):
    assert got.dtype == dtype and got.shape == expected.shape
    assert_close(got, expected.astype(np.float64), dtype, ulps=16)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("index_dtype", INDEX, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,axis,ishape", [((6, 4), 0, (9,)), ((3, 5, 2), 1, (2, 4)),
                                               ((4, 7), -1, (5,)), ((5,), 0, ())], ids=str)
def test_gather_grad(rng, dtype, index_dtype, shape, axis, ishape):
    a = axis % len(shape)
    idx = rng.integers(-shape[a], shape[a], ishape).astype(index_dtype)
    dy = rng.standard_normal(shape[:a] + ishape + shape[a + 1:]).astype(dtype)
    (expected,) = ort_oracle.run_node("GatherGrad", [np.array(shape, np.int64), idx, dy],
                                      out_dtypes=[dtype], axis=axis)
    check(ops.gather_grad(np.array(shape, np.int64), jnp.asarray(idx), jnp.asarray(dy), axis=axis),
          expected, dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("index_dtype", INDEX, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,dshape,axis", [((5, 4), (7, 4), 0), ((5, 4), (3, 6), 1),
                                               ((3, 4, 5), (3, 2, 9), -1)], ids=str)
def test_gather_elements_grad(rng, dtype, index_dtype, shape, dshape, axis):
    a = axis % len(shape)
    idx = rng.integers(-shape[a], shape[a], dshape).astype(index_dtype)
    dy = rng.standard_normal(dshape).astype(dtype)
    (expected,) = ort_oracle.run_node("GatherElementsGrad", [dy, np.array(shape, np.int64), idx],
                                      axis=axis)
    check(ops.gather_elements_grad(jnp.asarray(dy), shape, jnp.asarray(idx), axis=axis),
          expected, dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,ishape,b", [((5, 4), (6, 1), 0), ((4, 3, 5), (2, 3, 2), 0),
                                            ((3, 4, 5), (3, 6, 1), 1),
                                            ((2, 3, 4, 5), (2, 3, 4, 1), 2)], ids=str)
def test_gather_nd_grad(rng, dtype, shape, ishape, b):
    idx = np.zeros(ishape, np.int64)  # ORT takes int64 indices only
    for j in range(ishape[-1]):
        idx[..., j] = rng.integers(-shape[b + j], shape[b + j], ishape[:-1])
    upd = rng.standard_normal(ishape[:-1] + shape[b + ishape[-1]:]).astype(dtype)
    (expected,) = ort_oracle.run_node("GatherNDGrad", [np.array(shape, np.int64), idx, upd],
                                      out_dtypes=[dtype], batch_dims=b)
    check(ops.gather_nd_grad(shape, jnp.asarray(idx), jnp.asarray(upd), batch_dims=b),
          expected, dtype)


# ORT 1.19.2's CPU SliceGrad fails ("narrowing_error") on negative axes and on a negative step
# along the last axis; test_gather.py covers both against numpy.
SLICES = [((6, 5), [1, 0], [4, 5], None, None), ((6, 5), [-4], [-1], [1], None),
          ((6, 5), [0, 1], [100, 4], [0, 1], [2, 2]), ((6, 5), [5], [-100], [0], [-2]),
          ((6, 5), [-1, 0], [0, 5], [0, 1], [-1, 3]),
          ((4, 3, 5), [2, 1], [-10, 4], [1, 2], [-1, 2]), ((4, 3, 5), [1, -10], [3, 10], [2, 0],
                                                           [1, 3])]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("index_dtype", INDEX, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,starts,ends,axes,steps", SLICES, ids=str)
def test_slice_grad(rng, dtype, index_dtype, shape, starts, ends, axes, steps):
    from jaxops.reference.gather import slice_count, slice_ranges
    dshape = tuple(slice_count(*r) for r in slice_ranges(shape, starts, ends, axes, steps))
    dy = rng.standard_normal(dshape).astype(dtype)
    inputs = [dy, np.array(shape, np.int64), np.array(starts, index_dtype),
              np.array(ends, index_dtype)]
    if axes is not None or steps is not None:
        inputs.append(np.array(axes if axes is not None else range(len(starts)), index_dtype))
    if steps is not None:
        inputs.append(np.array(steps, index_dtype))
    (expected,) = ort_oracle.run_node("SliceGrad", inputs)
    got = ops.slice_grad(jnp.asarray(dy), shape, starts, ends, axes, steps)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)
