"""ORT's training ops as JAX functions: `jaxops.ops.<snake_case ORT name>`.

Inputs are positional in ORT's order, attributes are keywords with ORT's names and defaults.
Each module here holds one op family: its public functions come from `define(...)` specs
(jaxops/_src/spec.py) and are listed in its `__all__`, beside any plain helpers. This package
gathers them; `ORT_OPS` maps (domain, op_type) to the function and `SPECS` name to the spec,
so a new family is one new file.
"""
import importlib
import pkgutil

from jaxops.ops._args import refuse_narrowed_ints

ORT_OPS = {}
SPECS = {}
__all__ = ["ORT_OPS", "SPECS"]


def _add_ort(key, fn, where):
    if key in ORT_OPS:
        raise ImportError(f"jaxops.ops: ORT op {key} defined twice (again in {where})")
    ORT_OPS[key] = fn


for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("_"):
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    _legacy = getattr(_module, "ORT_OPS", {})
    for _name in _module.__all__:
        if _name in globals():
            raise ImportError(f"jaxops.ops: {_name!r} defined twice (again in {_info.name})")
        _fn = getattr(_module, _name)
        if hasattr(_fn, "spec"):
            SPECS[_name] = _fn.spec
            if _fn.spec.ort is not None:
                _add_ort(_fn.spec.ort, _fn, _info.name)
        elif _legacy and callable(_fn) and not isinstance(_fn, type):
            _fn = refuse_narrowed_ints(_fn, f"jaxops.ops.{_name}")
        globals()[_name] = _fn
        __all__.append(_name)
    for _key, _fn in _legacy.items():
        _add_ort(_key, globals().get(_fn.__name__, _fn), _info.name)
