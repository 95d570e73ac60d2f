"""ORT's training ops as JAX functions: `jaxops.ops.<snake_case ORT name>`.

Inputs are positional in ORT's order, attributes are keywords with ORT's names and defaults.
Each module here holds one op family: its public functions come from `define(...)` specs
(jaxops/_src/spec.py) and are listed in its `__all__`, beside any plain helpers. This package
gathers them; `ORT_OPS` maps (domain, op_type) to the function and `SPECS` name to the spec,
so a new family is one new file.
"""
import importlib
import pkgutil

ORT_OPS = {}
SPECS = {}
__all__ = ["ORT_OPS", "SPECS"]

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("_"):
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _name in _module.__all__:
        if _name in globals():
            raise ImportError(f"jaxops.ops: {_name!r} defined twice (again in {_info.name})")
        _fn = globals()[_name] = getattr(_module, _name)
        __all__.append(_name)
        _spec = getattr(_fn, "spec", None)
        if _spec is None:
            continue  # a plain helper (an axis name, a registration function)
        SPECS[_name] = _spec
        if _spec.ort in ORT_OPS:
            raise ImportError(f"jaxops.ops: ORT op {_spec.ort} defined twice (in {_info.name})")
        if _spec.ort is not None:
            ORT_OPS[_spec.ort] = _fn
