"""SoftmaxGrad, SoftmaxGrad_13, LogSoftmaxGrad, LogSoftmaxGrad_13 (com.microsoft).

The second input is the forward OUTPUT for all four (ORT names LogSoftmaxGrad's `X`, but it
is the log-softmax output). The plain ops sum over every dim from `axis` to the end (ORT's
pre-opset-13 rule, input coerced to 2-D); the _13 ops sum over `axis` alone.

Differentiation: each op is linear in dY. The jvp applies the kernel to the dY tangent and
writes the Y part in jnp; the transpose in dY is the op itself for SoftmaxGrad (its Jacobian
diag(Y) - Y Y^T is symmetric) and `log_softmax_grad_transpose` for LogSoftmaxGrad, whose own
transpose is LogSoftmaxGrad again. So gradients of any order exist and reverse mode runs the
kernels.
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxops._src import rules
from jaxops._src.op import Factors, Op, batch_at_front, is_undefined, is_zero
from jaxops._src.spec import Matrix, define
from jaxops.reference import softmax as ref

def _shape(dY, Y, *, axis, through_end):
    rules.floats(dY=dY, Y=Y)
    rules.same_shape(dY=dY, Y=Y)
    if dY.ndim == 0:
        raise ValueError("dY and Y must have rank >= 1, got scalars")
    rules.axis(axis, dY.ndim)
    return jax.ShapeDtypeStruct(dY.shape, dY.dtype)


def _ffi_attrs(dY, Y, *, axis, through_end):
    return {"axis": np.int64(axis % dY.ndim), "through_end": np.int64(through_end)}


def _factors(dY, Y, *, axis, through_end):
    dims = tuple(f"d{i}" for i in range(dY.ndim))
    reduced = tuple(dims[i] for i in ref.reduced_axes(dY.ndim, axis, through_end))
    return Factors((dims, dims), (dims,), reduced)


def _batch(op, args, dims, *, axis, through_end):
    args = batch_at_front(args, dims)
    return op.bind(*args, axis=axis % (args[0].ndim - 1) + 1, through_end=through_end), 0


def _sum(x, axis, through_end):
    return jnp.sum(x, axis=ref.reduced_axes(x.ndim, axis, through_end), keepdims=True)


def _jvp(y_part):
    """jvp of an op linear in dY: the kernel on the dY tangent plus `y_part` for Y's."""
    def jvp(op, primals, tangents, *, axis, through_end):
        (dy, y), (t_dy, t_y) = primals, tangents
        out = op.bind(dy, y, axis=axis, through_end=through_end)
        parts = []
        if not is_zero(t_dy):
            parts.append(op.bind(t_dy, y, axis=axis, through_end=through_end))
        if not is_zero(t_y):
            parts.append(y_part(dy, y, t_y, axis, through_end))
        return out, sum(parts[1:], parts[0])
    return jvp


def _softmax_y_part(dy, y, t_y, axis, through_end):
    return t_y * (dy - _sum(dy * y, axis, through_end)) - y * _sum(dy * t_y, axis, through_end)


def _log_softmax_y_part(dy, y, t_y, axis, through_end):
    return -jnp.exp(y) * t_y * _sum(dy, axis, through_end)


def _transpose(adjoint):
    """Transpose rule of an op linear in its first operand; adjoint(op, through_end) gives
    the op computing the adjoint map."""
    def transpose(op, ct, x, y, *, axis, through_end):
        if is_undefined(y) or not is_undefined(x):
            raise NotImplementedError(f"{op.name} is linear in its first operand only")
        if is_zero(ct):
            return None, None
        return adjoint(op, through_end).bind(ct, y, axis=axis, through_end=through_end), None
    return transpose


def _op(name, target, reference, jvp, adjoint):
    return Op(name, shape=_shape, reference=reference, batch=_batch, target=target,
              ffi_attrs=_ffi_attrs, factors=_factors, jvp=jvp, transpose=_transpose(adjoint))


_self_adjoint = lambda op, through_end: op  # SoftmaxGrad's Jacobian is symmetric
_SOFTMAX_GRAD = _op("softmax_grad", "jaxops_softmax_grad", ref.softmax_grad,
                    _jvp(_softmax_y_part), _self_adjoint)
_SOFTMAX_GRAD_13 = _op("softmax_grad_13", "jaxops_softmax_grad", ref.softmax_grad,
                       _jvp(_softmax_y_part), _self_adjoint)
_log_adjoint = lambda op, through_end: _LOG_SOFTMAX_GRAD_TRANSPOSE
_LOG_SOFTMAX_GRAD = _op("log_softmax_grad", "jaxops_log_softmax_grad", ref.log_softmax_grad,
                        _jvp(_log_softmax_y_part), _log_adjoint)
_LOG_SOFTMAX_GRAD_13 = _op("log_softmax_grad_13", "jaxops_log_softmax_grad",
                           ref.log_softmax_grad, _jvp(_log_softmax_y_part), _log_adjoint)
# The adjoint of LogSoftmaxGrad in dY, plain XLA code (it is log_softmax's forward-mode
# derivative, which XLA fuses well); its own adjoint is the LogSoftmaxGrad kernel.
_LOG_SOFTMAX_GRAD_TRANSPOSE = Op(
    "log_softmax_grad_transpose", shape=_shape, reference=ref.log_softmax_grad_transpose,
    batch=_batch, impl=ref.log_softmax_grad_transpose,
    transpose=_transpose(lambda op, through_end:
                         _LOG_SOFTMAX_GRAD if through_end else _LOG_SOFTMAX_GRAD_13))


def _pair(log):
    """Matrix inputs: dY and a (log-)softmax output Y over the last dim."""
    def make(rng, shape, dtype):
        x = rng.standard_normal(shape)
        y = x - np.log(np.exp(x).sum(-1, keepdims=True))
        return (jnp.asarray(rng.standard_normal(shape), dtype),
                jnp.asarray(y if log else np.exp(y), dtype))
    return make


_MS = "com.microsoft"


def _softmax_family(name, op_type, op, reference, axis, through_end, y_name, doc):
    return define(
        name, ort=(_MS, op_type), inputs=("dY: float", f"{y_name}: float"), outputs=("dX",),
        attrs={"axis": axis}, op=op, params={"through_end": through_end},
        reference=lambda dY, Y, *, axis: reference(dY, Y, axis, through_end), doc=doc,
        # axis -1 keeps dim 0 a row dim, which shards with no gather
        matrix=Matrix(_pair("log" in name), attrs={"axis": -1}, grad=(0, 1)))


softmax_grad = _softmax_family(
    "softmax_grad", "SoftmaxGrad", _SOFTMAX_GRAD, ref.softmax_grad, 1, True, "Y",
    """ORT SoftmaxGrad: dX = Y * (dY - sum(dY * Y)), the sum over all dims from `axis` on.

    Y is the softmax output. f16/bf16 accumulate in f32.
    """)
softmax_grad_13 = _softmax_family(
    "softmax_grad_13", "SoftmaxGrad_13", _SOFTMAX_GRAD_13, ref.softmax_grad, -1, False, "Y",
    """ORT SoftmaxGrad_13: dX = Y * (dY - sum(dY * Y)), the sum over `axis` only.""")
log_softmax_grad = _softmax_family(
    "log_softmax_grad", "LogSoftmaxGrad", _LOG_SOFTMAX_GRAD, ref.log_softmax_grad, 1, True, "X",
    """ORT LogSoftmaxGrad: dX = dY - exp(X) * sum(dY), the sum over all dims from `axis` on.

    X is the log-softmax OUTPUT (ORT's name for it). f16/bf16 accumulate in f32.
    """)
log_softmax_grad_13 = _softmax_family(
    "log_softmax_grad_13", "LogSoftmaxGrad_13", _LOG_SOFTMAX_GRAD_13, ref.log_softmax_grad, -1,
    False, "X", """ORT LogSoftmaxGrad_13: dX = dY - exp(X) * sum(dY), the sum over `axis` only.""")


def log_softmax_grad_transpose(ct, X, axis=-1, through_end=False):
    """Not an ORT op: the adjoint of log_softmax_grad(_13) in dY, ct - sum(ct * exp(X))."""
    return _LOG_SOFTMAX_GRAD_TRANSPOSE(ct, X, axis=axis, through_end=through_end)


__all__ = ["log_softmax_grad", "log_softmax_grad_13", "softmax_grad", "softmax_grad_13"]
