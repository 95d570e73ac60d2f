"""ConcatTraining and SplitTraining against onnxruntime-training 1.19.2 itself (CPU)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")

CONCAT_DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int16, np.int32, np.int64,
                 np.uint8, np.uint16, np.uint32, np.uint64, np.bool_]
SPLIT_DTYPES = [np.float32, np.int32, np.int64]  # all that ORT 1.19.2's CPU kernel runs


def _random(rng, shape, dtype):
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 100).astype(dtype)


LAYOUTS = [([(2, 3), (2, 5)], 1), ([(2, 3), (4, 3), (1, 3)], 0), ([(2, 3, 4), (2, 1, 4)], -2),
           ([(3,), (0,)], 0)]
CONCAT_CASES = [(d, *c) for d in CONCAT_DTYPES for c in (LAYOUTS if d == np.float32 else LAYOUTS[::2])]


@pytest.mark.parametrize("dtype,shapes,axis", CONCAT_CASES,
                         ids=[f"{np.dtype(c[0]).name}-{i}" for i, c in enumerate(CONCAT_CASES)])
def test_concat_training(rng, dtype, shapes, axis):
    xs = [_random(rng, s, dtype) for s in shapes]
    out, lengths = ort_oracle.run_node("ConcatTraining", xs, [dtype, np.int64], axis=axis)
    got, got_lengths = ops.concat_training(*map(jnp.asarray, xs), axis=axis)
    assert got.dtype == out.dtype
    np.testing.assert_array_equal(np.asarray(got), out)
    assert got_lengths.dtype == lengths.dtype and got_lengths.shape == lengths.shape
    np.testing.assert_array_equal(got_lengths, lengths)


@pytest.mark.parametrize("dtype", SPLIT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,split,axis", [((2, 8), [3, 5], 1), ((6, 2), [1, 0, 5], 0),
                                              ((2, 3, 4), [1, 3], -1), ((6, 4), [], 0),
                                              ((2, 6), [], -1)])
def test_split_training(rng, dtype, shape, split, axis):
    x = _random(rng, shape, dtype)
    n = len(split) or 3  # an empty split: three equal parts
    expected = ort_oracle.run_node("SplitTraining", [x, np.array(split, np.int64)], [dtype] * n,
                                   axis=axis)
    got = ops.split_training(jnp.asarray(x), np.array(split, np.int64), axis=axis,
                             num_outputs=n)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(g), e)


def test_uneven_empty_split_is_refused_by_both(rng):
    x = _random(rng, (2, 5), np.float32)
    with pytest.raises(Exception, match="split evenly"):
        ort_oracle.run_node("SplitTraining", [x, np.zeros(0, np.int64)], [np.float32] * 2, axis=1)
    with pytest.raises(ValueError, match="divide evenly"):
        ops.split_training(jnp.asarray(x), [], axis=1, num_outputs=2)
