"""Differentiable building blocks whose gradients run jaxops kernels.

Each module holds one family and lists its public names in `__all__`; all are gathered here.
"""
import importlib
import pkgutil

from jaxops._src.rules import refuse_narrowed_ints

__all__ = []

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _name in _module.__all__:
        # host int64 inputs are refused rather than narrowed while x64 is off (_src/rules.py)
        globals()[_name] = refuse_narrowed_ints(getattr(_module, _name), f"jaxops.nn.{_name}")
        __all__.append(_name)
