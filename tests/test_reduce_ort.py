"""ReduceSumTraining against onnxruntime-training 1.19.2 itself (CPU)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,axes", [((2, 3, 4), [0, -1]), ((2, 3, 4), []),
                                        ((3, 5), [-2, 1])], ids=str)
@pytest.mark.parametrize("attrs", [{}, {"keepdims": 0, "noop_with_empty_axes": 1}], ids=str)
def test_matches_onnxruntime(rng, dtype, shape, axes, attrs):
    if np.issubdtype(dtype, np.integer):
        x = rng.integers(-1000, 1000, shape).astype(dtype)
    else:
        x = rng.standard_normal(shape).astype(dtype)
    (expected,) = ort_oracle.run_node("ReduceSumTraining", [x, np.array(axes, np.int64)], **attrs)
    got = ops.reduce_sum_training(jnp.asarray(x), np.array(axes, np.int64), **attrs)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if np.issubdtype(dtype, np.integer):
        np.testing.assert_array_equal(np.asarray(got), expected)
    else:
        # both round a sum of the same terms: a few ulps of the sum of magnitudes
        scale = np.abs(ops.reduce_sum_training(np.abs(x.astype(np.float64)), axes, **attrs))
        err = np.abs(np.asarray(got, np.float64) - expected.astype(np.float64))
        assert np.all(err <= 8 * float(np.finfo(dtype).eps) * (np.asarray(scale) + np.abs(expected)))
