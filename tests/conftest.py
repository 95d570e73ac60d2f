"""Test setup: 8 forced CPU devices (for sharding tests) and float64 enabled, before jax loads."""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
# Tests compare with float64 references and ORT's CPU kernels: XLA's GPU dots and convolutions
# must not round f32 operands to TF32 (its default on Ampere and newer) there.
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

from helpers import new_rng  # noqa: E402


@pytest.fixture
def rng():
    return new_rng()
