"""DropoutGrad against onnxruntime-training 1.19.2 (CPU), with the inputs ORT's gradient
builder wires up: DropoutGrad(dY, mask, ratio, training_mode)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops
from helpers import assert_close

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")


@pytest.mark.parametrize("dtype,ratio_dtype", [(np.float32, np.float32), (np.float16, np.float32),
                                               (np.float16, np.float16), (np.float64, np.float64)],
                         ids=["f32", "f16-f32ratio", "f16", "f64"])
@pytest.mark.parametrize("ratio", [None, 0.0, 0.1, 0.3, 0.5, 0.9], ids=str)
@pytest.mark.parametrize("training_mode", [None, True, False], ids=str)
def test_dropout_grad_matches_onnxruntime(rng, dtype, ratio_dtype, ratio, training_mode):
    dy = rng.standard_normal((4, 33)).astype(dtype)
    mask = rng.random((4, 33)) > 0.3
    inputs = [dy, mask]
    if ratio is not None or training_mode is not None:
        inputs.append(None if ratio is None else np.array(ratio, ratio_dtype))
    if training_mode is not None:
        inputs.append(np.array(training_mode))
    (expected,) = ort_oracle.run_node("DropoutGrad", inputs)
    got = ops.dropout_grad(*[None if x is None else jnp.asarray(x) for x in inputs])
    assert got.dtype == dtype
    # ORT's f64 kernel forms 1 / (1 - ratio) in float precision (see jaxops.ops.dropout)
    assert_close(got, expected.astype(np.float64), np.float32 if dtype == np.float64 else dtype,
                 ulps=2)
