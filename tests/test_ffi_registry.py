"""The extensions register exactly the FFI targets of the one list (ffi/include/jaxops/registry.h),
and a missing one is a clear ImportError at registration, not a failure at the first call."""
import importlib

import pytest

from jaxops import _cpu
from jaxops._src.ffi import available_platforms, check_targets


def _modules():
    mods = [_cpu]
    try:
        mods.append(importlib.import_module("jaxops._cuda"))
    except ImportError:  # built without a CUDA compiler
        pass
    return mods


@pytest.mark.parametrize("module", _modules(), ids=lambda m: m.__name__)
def test_registrations_equal_the_expected_targets(module):
    expected = module.expected_targets()
    assert len(expected) == len(set(expected)), "kTargets lists a target twice"
    assert set(module.registrations()) == set(expected)
    assert all(name.startswith("jaxops_") for name in expected)


# CPU paths with no CUDA counterpart (registry.h: kCpuTargets)
CPU_ONLY = {"jaxops_conv_nhwc", "jaxops_depthwise_conv", "jaxops_depthwise_conv_dx",
            "jaxops_depthwise_conv_dw", "jaxops_max_pool_nhwc", "jaxops_take_ranges"}


def test_both_extensions_expect_one_list():
    assert CPU_ONLY <= set(_cpu.expected_targets())
    lists = [sorted(set(m.expected_targets()) - CPU_ONLY) for m in _modules()]
    assert all(x == lists[0] for x in lists)
    for m in _modules()[1:]:
        assert not CPU_ONLY & set(m.expected_targets())


def test_registration_passes_the_check():
    assert "cpu" in available_platforms()


def test_a_missing_target_is_a_clear_import_error():
    expected = _cpu.expected_targets()
    registered = set(_cpu.registrations()) - {"jaxops_gather_grad", "jaxops_sce_bwd"}
    with pytest.raises(ImportError, match="jaxops._cpu does not register the FFI target") as e:
        check_targets("_cpu", registered, expected)
    assert "jaxops_gather_grad, jaxops_sce_bwd" in str(e.value)
    assert "rebuild" in str(e.value)


def test_extra_registrations_are_not_an_error():
    check_targets("_cpu", list(_cpu.registrations()) + ["jaxops_extra"], _cpu.expected_targets())
