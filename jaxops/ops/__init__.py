"""ORT's training ops as JAX functions: `jaxops.ops.<snake_case ORT name>`.

Inputs are positional in ORT's order, attributes are keywords with ORT's names and defaults.
`ORT_OPS` maps (domain, op_type) to the function; the ONNX importer uses it and nothing else.

Each module here holds one op family and declares its public functions in `__all__` and its
table entries in `ORT_OPS`; this package gathers both, so a new family is one new file.
"""
import importlib
import inspect
import pkgutil

from jaxops.ops._args import refuse_narrowed_ints

ORT_OPS = {}
__all__ = ["ORT_OPS"]
_checked = {}  # id(function) -> the function behind the host-int64 check, one per function


def _public(fn, name):
    """Every public op passes its host inputs through refuse_narrowed_ints (see _args.py):
    this is the one place all of them share."""
    if not callable(fn) or inspect.isclass(fn):
        return fn
    if id(fn) not in _checked:
        _checked[id(fn)] = refuse_narrowed_ints(fn, f"jaxops.ops.{name}")
    return _checked[id(fn)]


for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("_"):
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _name in _module.__all__:
        if _name in globals():
            raise ImportError(f"jaxops.ops: {_name!r} defined twice (again in {_info.name})")
        globals()[_name] = _public(getattr(_module, _name), _name)
        __all__.append(_name)
    for _key, _fn in getattr(_module, "ORT_OPS", {}).items():
        if _key in ORT_OPS:
            raise ImportError(f"jaxops.ops: ORT op {_key} defined twice (again in {_info.name})")
        ORT_OPS[_key] = _public(_fn, getattr(_fn, "__name__", _key[1]))
