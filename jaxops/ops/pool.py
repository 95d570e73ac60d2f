"""MaxPoolGrad and AveragePoolGrad (ONNX domain, ORT-private CPU training kernels, outside the
89-op CUDA registry, but in the graphs ORT's gradient builder makes for MaxPool/AveragePool):
MaxPoolGrad as one XLA scatter-add, AveragePoolGrad as the transpose of a windowed sum.

Both take X's shape as the jaxops option `x_shape` (ORT's kernels read it from the graph's
value info; jaxops' importer passes it from the graph)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops._src import geometry, rules
from jaxops._src.spec import REQUIRED, Matrix, define


def _x_shape(x_shape, dY):
    """x_shape as ints, its dim 0 replaced by dY's (as ORT does)."""
    shape = tuple(rules.integer("x_shape", i) for i in x_shape)
    return (dY.shape[0],) + shape[1:] if shape else shape


def _forward_input_shape(ctx):
    """The shape of the forward pooling's input X, which a pooling gradient's output has:
    from the MaxPool whose Indices it reads, else from the pooling whose output's gradient
    (ORT names it `<Y>_grad`) it takes, else from its own output `<X>_grad`, else as the
    model declares that output (symbolic dims bound to this call's sizes)."""
    node = ctx.node
    forward = ctx.producer(node.input[1]) if len(node.input) > 1 else None
    if forward is None and node.input[0].endswith("_grad"):
        forward = ctx.producer(node.input[0][:-len("_grad")])
    if forward is not None and forward.op_type in ("MaxPool", "AveragePool") and forward.input:
        shape = ctx.shape_of(forward.input[0])
        if shape is not None:
            return shape
    out = node.output[0] if node.output else ""
    if out.endswith("_grad"):
        shape = ctx.shape_of(out[:-len("_grad")])
        if shape is not None:
            return shape
    return ctx.output_shape(0)


def _graph_x_shape(ctx, dY, *rest):
    """The importer's `x_shape`: ORT reads the declared shape of the node's output; jaxops
    takes X's shape from the forward graph first. Checked against the memory budget before
    the op allocates it."""
    shape = _forward_input_shape(ctx)
    if shape is None:
        raise ctx.error(f"{ctx.node.op_type}: the shape of the forward input X is unknown: no "
                        "MaxPool/AveragePool feeds it and its output's shape is not declared")
    ctx.check_size(shape, getattr(dY, "dtype", "float32"))
    return {"x_shape": shape}


# ---- MaxPoolGrad

def _check_max_pool_grad(dY, Indices, *, x_shape, **maxpool_attrs):
    rules.same_shape(dY=dY, Indices=Indices)
    shape = _x_shape(x_shape, dY)
    if len(shape) != dY.ndim or dY.ndim < 3:
        raise ValueError(f"x_shape must have dY's rank {dY.ndim} (>= 3), got {tuple(x_shape)}")


def _max_pool_grad(dY, Indices, *, x_shape, **maxpool_attrs):
    shape = _x_shape(x_shape, dY)
    size = int(np.prod(shape))
    flat = Indices.reshape(-1)
    flat = jnp.where((flat < 0) | (flat >= size), size, flat)  # dropped, never wrapped
    acc = rules.compute_dtype(dY.dtype)
    dX = jnp.zeros(size, acc).at[flat].add(dY.reshape(-1).astype(acc), mode="drop")
    return dX.astype(dY.dtype).reshape(shape)


def _max_pool_make(rng, shape, dtype):
    """dY [N, 2, 2, 2] and MaxPool's flat Indices into X [N, 2, 4, 4] (2x2 windows, stride 2:
    each index inside its own window and plane)."""
    n = shape[0]
    r, q = rng.integers(0, 2, (2, n, 2, 2, 2))
    b, c, i, j = np.indices((n, 2, 2, 2))
    idx = ((b * 2 + c) * 4 + 2 * i + r) * 4 + 2 * j + q
    return jnp.asarray(rng.standard_normal((n, 2, 2, 2)), dtype), jnp.asarray(idx, jnp.int32)


max_pool_grad = define(
    "max_pool_grad", ort=("", "MaxPoolGrad"), inputs=("dY: float", "Indices: index"),
    outputs=("dX",),
    # MaxPool's attributes, which ORT's builder copies onto the node (ORT's schema declares
    # none: kernel_shape is optional here)
    attrs={"auto_pad": "NOTSET", "ceil_mode": 0, "dilations": None, "kernel_shape": None,
           "pads": None, "storage_order": 0, "strides": None},
    options={"x_shape": REQUIRED}, graph=_graph_x_shape, check=_check_max_pool_grad,
    reference=_max_pool_grad,
    doc="""ORT MaxPoolGrad (ONNX domain, ORT-private; CPU training kernel, outside the 89-op CUDA
    training registry): the gradient of MaxPool from dY and MaxPool's second output Indices.

    dX = zeros(x_shape) with dX.flat[Indices[i]] += dY[i]: Indices are flat indices into the
    whole X tensor (batch and channel included), as MaxPool writes them for storage_order=0.
    ORT's kernel reads X's shape from the graph's value info; here it is the keyword
    `x_shape`, whose dim 0 is replaced by dY's (as ORT does). MaxPool's attributes, which
    ORT's builder copies onto the node, are accepted and ignored, storage_order included:
    like ORT, indices made with storage_order=1 (column-major within each plane) are applied
    as row-major flat indices. An index outside [0, numel(X)) -- out-of-bounds memory in
    ORT -- is dropped here. Duplicate indices (overlapping windows) accumulate.""",
    matrix=Matrix(_max_pool_make, attrs={"x_shape": (1, 2, 4, 4)}, grad=(0,), shard=False,
                  skip="Indices address all of X, batch included: the scatter reads no "
                       "shard boundary, so XLA gathers a dim-0-sharded dY"))


# ---- AveragePoolGrad

def _pool_pads(x_shape, dy_shape, kernel, strides, pads, auto_pad, ceil_mode):
    """Per spatial dim (pad_begin, pad_end, extra), the extra end pad making the windows
    exactly dY's spatial size (ceil_mode's partial last window)."""
    spatial = x_shape[2:]
    n = len(spatial)
    if auto_pad not in ("NOTSET", "VALID") + geometry.SAME:
        raise ValueError(f"unknown auto_pad {auto_pad!r}")
    if auto_pad == "NOTSET" and pads is not None and len(pads) != 2 * n:
        raise ValueError(f"pads must hold 2 x {n} values, got {list(pads)}")
    pairs = geometry.padding(auto_pad, spatial, kernel, strides, [1] * n, pads)
    out = []
    for size, k, st, (b, e), got in zip(spatial, kernel, strides, pairs, dy_shape[2:]):
        if geometry.pool_output_size(size, k, st, b, e, ceil_mode) != got:
            raise ValueError(f"dY's spatial shape {tuple(dy_shape[2:])} does not match the "
                             f"pooling of x_shape {tuple(x_shape)}")
        out.append((b, e, max(0, (got - 1) * st + k - (size + b + e))))
    return out


def _average_pool_geometry(dY, *, x_shape, kernel_shape, strides, pads, auto_pad, ceil_mode,
                           count_include_pad, dilations):
    """(X's shape, kernel, strides, per-dim (begin, end, extra) pads), checked."""
    kernel = tuple(rules.integer("kernel_shape", k) for k in kernel_shape)
    shape = _x_shape(x_shape, dY)
    n = dY.ndim - 2
    if dY.ndim < 3 or len(shape) != dY.ndim or len(kernel) != n:
        raise ValueError(f"dY (rank {dY.ndim} >= 3), x_shape {tuple(x_shape)} and kernel_shape "
                         f"{kernel} must agree in rank")
    strides = tuple(rules.integer("strides", i) for i in (strides or [1] * n))
    if any(d != 1 for d in (dilations or [1] * n)):
        raise ValueError(f"dilations other than 1 are not supported, got {dilations}")
    if len(strides) != n or min(kernel + strides) < 1:
        raise ValueError(f"kernel_shape {kernel} and strides {strides} must be {n} positive "
                         "values")
    if shape[1] != dY.shape[1]:
        raise ValueError(f"x_shape {tuple(x_shape)} and dY {dY.shape} differ in channels")
    return shape, kernel, strides, _pool_pads(shape, dY.shape, kernel, strides, pads, auto_pad,
                                              ceil_mode)


def _average_pool_grad(dY, **attrs):
    shape, kernel, strides, pads3 = _average_pool_geometry(dY, **attrs)
    acc = rules.compute_dtype(dY.dtype)
    window, step = (1, 1) + kernel, (1, 1) + strides
    pad = ((0, 0), (0, 0)) + tuple((b, e + extra) for b, e, extra in pads3)
    if attrs["count_include_pad"]:  # ORT's forward divides every window by its full size
        counts = float(np.prod(kernel))
    else:
        counts = lax.reduce_window(jnp.ones((1, 1) + shape[2:], acc), np.zeros((), acc),
                                   lax.add, window, step, pad)

    def pool(x):
        return lax.reduce_window(x, np.zeros((), acc), lax.add, window, step, pad) / counts

    (dX,) = jax.linear_transpose(pool, jax.ShapeDtypeStruct(shape, acc))(dY.astype(acc))
    return dX.astype(dY.dtype)


average_pool_grad = define(
    "average_pool_grad", ort=("", "AveragePoolGrad"), inputs=("dY: float",), outputs=("dX",),
    attrs={"kernel_shape": REQUIRED, "strides": None, "pads": None, "auto_pad": "NOTSET",
           "ceil_mode": 0, "count_include_pad": 0, "dilations": None},
    options={"x_shape": REQUIRED}, graph=_graph_x_shape, check=_average_pool_geometry,
    reference=_average_pool_grad,
    doc="""ORT AveragePoolGrad (ONNX domain, ORT-private): the gradient of AveragePool.

    The exact gradient of ORT's AveragePool: each dY element spreads evenly over the input
    positions its window covers, divided by the full window size with count_include_pad=1
    (ORT's forward divides so even where ceil_mode's last window sticks out of the padded
    input) and by the number of input positions it covers otherwise. X's shape comes from
    the graph's value info in ORT; here it is `x_shape`, whose dim 0 is replaced by dY's.

    ORT 1.19.2's CPU AveragePoolGrad kernel disagrees with its own forward in two cases, where
    this follows the forward: 3-D pooling, and auto_pad=SAME_LOWER (its gradient puts the odd
    pad at the end, as for SAME_UPPER).""",
    # dY [N, 2, 2, 2] from 4x4 planes pooled 2x2 (x_shape's dim 0 comes from dY)
    matrix=Matrix(lambda rng, shape, dtype: (
        jnp.asarray(rng.standard_normal((shape[0], 2, 2, 2)), dtype),),
        attrs={"x_shape": (1, 2, 4, 4), "kernel_shape": (2, 2), "strides": (2, 2)}, grad=(0,)))

__all__ = ["average_pool_grad", "max_pool_grad"]
