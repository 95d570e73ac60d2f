"""Shared test helpers: fresh random inputs, dtype-derived tolerances, HLO checks, a fresh
process."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

FLOAT_DTYPES = [jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16]
DTYPE_IDS = ["f32", "f64", "f16", "bf16"]


def new_rng():
    """A generator seeded afresh each run; the seed is printed, so pytest shows it on failure."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def assert_close(actual, expected, dtype, *, ulps=8, scale=None):
    """|actual - expected| <= ulps * eps(dtype) * (s + max s), s = |expected| unless `scale`
    gives it: relative for large entries, scaled to the tensor's magnitude for entries near
    cancellation. A sum of terms passes `scale` = the sum of their magnitudes."""
    a = np.asarray(jnp.asarray(actual, jnp.float64) if dtype != jnp.float64 else actual,
                   np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    assert np.all(np.isfinite(a)), "non-finite output"
    s = np.abs(e) if scale is None else np.asarray(scale, np.float64)
    tol = ulps * eps(dtype) * (s + s.max(initial=0.0))
    bad = np.abs(a - e) > tol
    assert not bad.any(), (f"{bad.sum()} of {bad.size} entries off; worst "
                           f"{np.abs(a - e).max():.3e} vs tol {tol.max():.3e}")


def world(on_cpu):
    """Ranks for a collective test: `on_cpu` forced CPU devices, or every GPU of the machine
    under JAX_PLATFORMS=cuda (the same tests on NCCL)."""
    return on_cpu if jax.default_backend() == "cpu" else len(jax.devices())


def on_cpu_devices(n=4):
    devices = jax.devices("cpu") if jax.default_backend() == "cpu" else jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, have {len(devices)}")
    return devices[:n]


def ort_available():
    try:
        import onnxruntime  # noqa: F401
        from onnxruntime.capi import _pybind_state  # noqa: F401
    except ImportError:
        return False
    return True


def train_losses(module, optimizer, batches):
    """ORT's training loop over `batches` (tuples of a module's inputs): module(*batch),
    optimizer.step(), module.lazy_reset_grad(); the losses as floats."""
    losses = []
    for batch in batches:
        losses.append(float(module(*batch)))
        optimizer.step()
        module.lazy_reset_grad()
    return losses


def fresh_process(script, *args, timeout=120) -> str:
    """`script`'s stdout in a user's fresh process: one CPU device (conftest forces 8, which
    sizes XLA's pools too), none of XLA's thread or flag settings (a script sets its own
    XLA_FLAGS before it imports jax)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", script, *args],
                         env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
