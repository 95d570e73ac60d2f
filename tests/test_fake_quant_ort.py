"""FakeQuant against onnxruntime-training 1.19.2 (CPU), where its CPU kernel and ORT's CUDA
kernel (which jaxops follows) agree: finite inputs and an integral zero_point."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")


@pytest.mark.parametrize("scale,zp,attrs", [(0.125, 0.0, {}), (0.125, 7.0, {"quant_min": -8,
                                                                            "quant_max": 7}),
                                            (0.1, -3.0, {"quant_min": -128, "quant_max": 127}),
                                            (0.37, 0.0, {})], ids=str)
@pytest.mark.parametrize("shaped", [False, True], ids=["scalar_params", "1d_params"])
def test_fake_quant_matches_onnxruntime(rng, scale, zp, attrs, shaped):
    x = (rng.standard_normal((5, 24)) * 6).astype(np.float32)
    x.flat[:4] = [0.0, 0.5 * scale, 1.5 * scale, -2.5 * scale]  # ties where scale is exact
    params = [np.array([v] if shaped else v, np.float32) for v in (scale, zp)]
    y, mask = ort_oracle.run_node("FakeQuant", [x, *params], out_dtypes=[np.float32, np.bool_],
                                  **attrs)
    got_y, got_mask = ops.fake_quant(jnp.asarray(x), *map(jnp.asarray, params), **attrs)
    # XLA:CPU's x / scale may be an ulp off the correctly rounded quotient: skip near-ties
    # unless the scale is a power of two (exact quotients)
    q = x.astype(np.float64) / scale
    near_tie = np.abs(np.abs(q - np.floor(q)) - 0.5) < 1e-5
    keep = np.ones_like(near_tie) if scale == 0.125 else ~near_tie
    np.testing.assert_array_equal(np.asarray(got_mask)[keep], mask[keep])
    np.testing.assert_array_equal(np.asarray(got_y)[keep], y[keep])
    assert keep.mean() > 0.9


def test_nan_matches_onnxruntime():
    x = np.array([np.nan, 1.0], np.float32)
    params = [np.array(0.5, np.float32), np.array(2.0, np.float32)]
    y, mask = ort_oracle.run_node("FakeQuant", [x, *params], out_dtypes=[np.float32, np.bool_])
    got_y, got_mask = ops.fake_quant(jnp.asarray(x), *map(jnp.asarray, params))
    np.testing.assert_array_equal(got_y, y)
    np.testing.assert_array_equal(got_mask, mask)
