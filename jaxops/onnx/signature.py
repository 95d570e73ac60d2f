"""The model's declared inputs checked against a call's values: element type families, static
dims, and symbolic dims bound consistently across inputs. A mismatch is an error naming the input, not a
failure deep inside some node (or a silent run on the wrong data)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from onnx import helper

from jaxops.onnx.errors import OnnxImportError


def _element_type(elem: int):
    """The numpy dtype of an ONNX element type, or None where numpy has none (strings...)."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem))
    except Exception:  # noqa: BLE001 - undefined or exotic element types are not checked
        return None


_FAMILIES = (jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating)


def _family(dtype):
    return next((f for f in _FAMILIES if jnp.issubdtype(dtype, f)), dtype)


def _accepts(declared: np.dtype, dtype: np.dtype) -> bool:
    """A value of `dtype` for an input of `declared`: the same family (bool, integer, floating,
    complex). Widths may differ, as in jax: int32 for int64 without 64-bit types, float64 to
    check a float32 model's gradients in double precision."""
    return dtype == declared or _family(dtype) == _family(declared)


def _check_tensor(name: str, tensor_type, value, dims: dict, what: str,
                  free_axes=()) -> None:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        value = np.asarray(value)
        dtype = value.dtype
    declared = _element_type(tensor_type.elem_type) if tensor_type.elem_type else None
    if declared is not None and not _accepts(declared, np.dtype(dtype)):
        raise OnnxImportError(f"{what} {name!r} must be {declared.name} (as the model declares), "
                              f"got {np.dtype(dtype).name}: cast it, e.g. x.astype(np."
                              f"{declared.name})")
    if not tensor_type.HasField("shape"):
        return
    declared_dims = tensor_type.shape.dim
    shape = tuple(np.shape(value))
    if len(declared_dims) != len(shape):
        raise OnnxImportError(f"{what} {name!r} must have rank {len(declared_dims)} (shape "
                              f"{_show(declared_dims)}), got shape {shape}")
    for axis, (d, n) in enumerate(zip(declared_dims, shape)):
        if axis in free_axes:
            continue
        if d.HasField("dim_value"):
            if d.dim_value != n:
                raise OnnxImportError(f"{what} {name!r} must have shape {_show(declared_dims)}, "
                                      f"got {shape} (dim {axis})")
        elif d.HasField("dim_param") and d.dim_param:
            bound = dims.setdefault(d.dim_param, (int(n), name))
            if bound[0] != n:
                raise OnnxImportError(
                    f"{what} {name!r} has {n} for dim {d.dim_param!r} (its dim {axis}), but "
                    f"input {bound[1]!r} has {bound[0]}: inputs that share a dim name must agree")


def _show(dims) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]


def check_inputs(graph_inputs, given: dict, free_axes=()) -> dict[str, int]:
    """Checks every declared input in `given` (name -> value); returns the symbolic dims bound
    by the call (dim name -> size). Sizes at `free_axes` are not checked."""
    dims: dict[str, tuple[int, str]] = {}
    for vi in graph_inputs:
        if vi.name not in given or not vi.HasField("type"):
            continue
        value, t = given[vi.name], vi.type
        kind = t.WhichOneof("value")
        if kind == "tensor_type":
            if value is None or isinstance(value, (list, tuple)):
                raise OnnxImportError(f"model input {vi.name!r} is a tensor, got "
                                      f"{type(value).__name__}")
            _check_tensor(vi.name, t.tensor_type, value, dims, "model input", free_axes)
        elif kind == "sequence_type" and t.sequence_type.elem_type.HasField("tensor_type"):
            if not isinstance(value, (list, tuple)):
                raise OnnxImportError(f"model input {vi.name!r} is a sequence: pass a list")
            for i, v in enumerate(value):  # elements may differ in shape: no dims bound
                _check_tensor(f"{vi.name}[{i}]", t.sequence_type.elem_type.tensor_type, v, {},
                              "model input")
    return {k: n for k, (n, _) in dims.items()}
