"""The softmax-gradient ops against onnxruntime-training 1.19.2 itself (CPU)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops
from helpers import assert_close

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")

# (ORT op, jaxops function, log, dtypes ORT 1.19.2 runs on CPU)
CASES = [
    ("SoftmaxGrad", ops.softmax_grad, False, [np.float32, np.float64, np.float16]),
    ("SoftmaxGrad_13", ops.softmax_grad_13, False, [np.float32, np.float16]),
    ("LogSoftmaxGrad", ops.log_softmax_grad, True, [np.float32, np.float16]),
    ("LogSoftmaxGrad_13", ops.log_softmax_grad_13, True, [np.float32, np.float16]),
]
PARAMS = [(name, fn, log, dt) for name, fn, log, dts in CASES for dt in dts]


@pytest.mark.parametrize("name,fn,log,dtype", PARAMS,
                         ids=[f"{p[0]}-{np.dtype(p[3]).name}" for p in PARAMS])
@pytest.mark.parametrize("shape,axis", [((3, 7), 1), ((3, 7), 0), ((2, 3, 4), 1),
                                        ((2, 3, 4), -1), ((2, 3, 4, 5), -2), ((5,), 0),
                                        ((3, 7), None), ((2, 3, 4), None)])  # None: default
def test_matches_onnxruntime(rng, name, fn, log, dtype, shape, axis):
    logits = rng.standard_normal(shape)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    y = e / e.sum(-1, keepdims=True)  # any positive Y exercises the formula
    y = (np.log(y) if log else y).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    attrs = {} if axis is None else {"axis": axis}
    (expected,) = ort_oracle.run_node(name, [dy, y], **attrs)
    got = fn(jnp.asarray(dy), jnp.asarray(y), **attrs)
    assert got.dtype == dtype
    # both sides round to dtype; ORT's f16 kernels also accumulate in lower precision
    assert_close(got, expected.astype(np.float64), dtype, ulps=16)
