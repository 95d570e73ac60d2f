"""Optimizers and gradient clipping: AdamWOptimizer, SGDOptimizerV2, AdamOptimizer,
SGDOptimizer, LambOptimizer, InplaceClipGradNorm (com.microsoft).

AdamWOptimizer and SGDOptimizerV2 (the ops `generate_artifacts` emits) run one multi-tensor
kernel over the whole parameter list: one CUDA launch per step (per 192 tensors). Their
updated lists alias the input lists, so a caller who donates the buffers
(`jax.jit(..., donate_argnums=...)`) updates them in place. lr, step and update_signal stay on
the device: the kernel reads them itself.

LambOptimizer runs a multi-tensor kernel too (one launch over a queue: each tensor's norms,
then its update).
AdamOptimizer and SGDOptimizer update one tensor per node and InplaceClipGradNorm is a norm
plus one scale: XLA code, which fuses each into a loop or two per tensor.

Sequence inputs are Python lists of arrays; sequence outputs are lists. ORT's `lambda`
attribute (AdamOptimizer, LambOptimizer) is a Python keyword: pass it as **{"lambda": v}.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxops._src import rules
from jaxops._src.op import Factors, Op
from jaxops._src.spec import Matrix, define
from jaxops.reference import optim as ref

_MS = "com.microsoft"

__all__ = ["adamw_optimizer", "sgd_optimizer_v2", "adam_optimizer", "sgd_optimizer",
           "lamb_optimizer", "inplace_clip_grad_norm"]


# ---- shared checks ----------------------------------------------------------------------------

def _one(x, label, dtypes, dtype_names):
    if x.dtype not in dtypes:
        raise TypeError(f"{label} must be {dtype_names}, got {x.dtype}")
    if int(np.prod(x.shape)) != 1:
        raise ValueError(f"{label} must hold one element, got shape {x.shape}")


def _check_lists(names, lists, grads_index=1):
    """Lists of one length, tensor i of one shape in every list, one float dtype per list;
    every list but the gradients shares the weights' dtype; gradients may be f16/bf16 with
    f32 weights."""
    n = len(lists[0])
    for name, xs in zip(names, lists):
        if len(xs) != n:
            raise ValueError(f"{names[0]} and {name} must have one length, got {n} and {len(xs)}")
        if len({x.dtype for x in xs}) > 1:
            raise TypeError(f"the tensors of {name} must share one dtype")
        for x in xs:
            if x.dtype not in rules.FLOATS:
                raise TypeError(f"{name} must be {rules.FLOAT_WORDS}, got {x.dtype}")
    for i in range(n):
        shapes = {tuple(xs[i].shape) for xs in lists}
        if len(shapes) > 1:
            raise ValueError(f"tensor {i} has different shapes across the lists: {sorted(shapes)}")
    if n:
        wt = lists[0][0].dtype
        for k, (name, xs) in enumerate(zip(names, lists)):
            if k == grads_index:
                ok = xs[0].dtype == wt or (wt == jnp.float32 and xs[0].dtype in
                                           (jnp.float16, jnp.bfloat16))
                if not ok:
                    raise TypeError(f"{name} must have the weights' dtype {wt} (or f16/bf16 "
                                    f"with f32 weights), got {xs[0].dtype}")
            elif xs[0].dtype != wt:
                raise TypeError(f"{name} must have the weights' dtype {wt}, got {xs[0].dtype}")


def _as_list(xs, label):
    """A sequence input (a list or tuple of arrays) as a list of jax arrays."""
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{label} must be a list of arrays, got {type(xs).__name__}")
    return [jnp.asarray(x) for x in xs]


def _signal(update_signal):
    return jnp.ones((1,), bool) if update_signal is None else update_signal


def _concrete(value):
    """value as a Python float, or None when it is traced (a jit argument, optax's
    inject_hyperparams): the kernels take hyperparameters as static FFI attributes, so a
    traced one sends the call to the reference (XLA code)."""
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        return None


def _attributes(extra):
    """ORT's `lambda` (a Python keyword, so it arrives in **attributes), default 0."""
    unknown = sorted(set(extra) - {"lambda"})
    if unknown:
        raise TypeError(f"unexpected attribute(s) {', '.join(unknown)}")
    return extra.get("lambda", 0.0)


# ---- multi-tensor kernels: flat operands (scalars..., list 0..., list 1..., ...) ----------------

@dataclasses.dataclass(frozen=True)
class _ListFactors(Factors):
    """Factors of independent tensors: each tensor (its copies in every list and its results)
    keeps the first sharding one of its operands has, whatever mesh axes the other tensors
    use (Factors' own assignment gives a mesh axis to one factor of the whole op). The
    factors of scalar operands (lr, step, flags), listed in `scalars`, stay replicated."""

    scalars: tuple[str, ...] = ()

    def shardings(self, mesh, operand_shardings):
        specs = {}
        for dims, sharding in zip(self.operands, operand_shardings):
            spec = tuple(getattr(sharding, "spec", ()))
            if dims and dims[0] not in self.scalars and dims not in specs and any(spec):
                specs[dims] = spec[:len(dims)]

        def sharding_of(dims):
            return NamedSharding(mesh, PartitionSpec(*specs.get(dims, ())))

        return [sharding_of(d) for d in self.operands], [sharding_of(d) for d in self.results]


def _tensor_factors(args, n_scalars, count, n_lists, results):
    """Factors of a flat multi-tensor op: scalar operands replicated, tensor i's dims shared by
    every list; results: `results` = (flag dims-of operand index, number of result lists)."""
    scalars = [tuple(f"s{k}_{d}" for d in range(args[k].ndim)) for k in range(n_scalars)]
    tensors = [tuple(f"t{i}_{d}" for d in range(args[n_scalars + i].ndim)) for i in range(count)]
    flag_of, out_lists = results
    return _ListFactors(tuple(scalars) + tuple(tensors) * n_lists,
                        (scalars[flag_of],) + tuple(tensors) * out_lists,
                        scalars=tuple(f for dims in scalars for f in dims))


def _batch_multi(n_scalars, n_lists, out_lists):
    """vmap rule: batched tensors go through the kernel with a leading batch dim (unbatched
    partners of a batched tensor are broadcast); a batched scalar (lr, step, signal) falls
    back to the vmapped reference, since the kernel takes one value of each."""
    def batch(op, args, dims, **params):
        count = params["count"]
        if any(d is not None for d in dims[:n_scalars]):
            out = jax.vmap(lambda *a: op.reference(*a, **params), in_axes=tuple(dims))(*args)
            return out, (0,) * len(out)
        args = list(args)
        out_dims = [None] * (1 + out_lists * count)
        for i in range(count):
            idx = [n_scalars + k * count + i for k in range(n_lists)]
            batched = [j for j in idx if dims[j] is not None]
            if not batched:
                continue
            size = args[batched[0]].shape[dims[batched[0]]]
            for j in idx:
                a, d = args[j], dims[j]
                args[j] = jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
            for k in range(out_lists):
                out_dims[1 + k * count + i] = 0
        return op.bind(*args, **params), tuple(out_dims)
    return batch


def _aliases(n_scalars, updated_lists):
    """Operand list updated_lists[k] -> result list k (result 0 is the flag)."""
    def aliases(*args, count, **params):
        return {n_scalars + lst * count + i: 1 + k * count + i
                for k, lst in enumerate(updated_lists) for i in range(count)}
    return aliases


# AdamW: operands (lr, step, signal, w..., g..., m1..., m2...) -> (flag, w..., m1..., m2...)
def _adamw_shape(lr, step, signal, *tensors, count, **attrs):
    _one(lr, "lr", (jnp.float32,), "float32")
    _one(step, "step", rules.INDEX, "int64 (or int32)")
    _one(signal, "update_signal", (jnp.bool_,), "bool")
    if attrs["adam_mode"] not in (0, 1):
        raise ValueError(f"adam_mode must be 0 or 1, got {attrs['adam_mode']}")
    if attrs["adam_mode"] == 0 and attrs["correct_bias"] != 1:
        raise ValueError("correct_bias must be 1 for adam_mode 0 (as ORT requires)")
    lists = [tensors[k * count:(k + 1) * count] for k in range(4)]
    _check_lists(["weights", "gradients", "momentums_1", "momentums_2"], lists)
    flag = jax.ShapeDtypeStruct(step.shape, jnp.bool_)
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for k in (0, 2, 3) for x in lists[k]]
    return (flag, *outs)


def _adamw_ref(lr, step, signal, *tensors, count, **attrs):
    lists = [list(tensors[k * count:(k + 1) * count]) for k in range(4)]
    flag, w, m1, m2 = ref.adamw_optimizer(lr, step, *lists, signal, **attrs)
    return (flag, *w, *m1, *m2)


def _adamw_attrs(*args, count, alpha, beta, epsilon, weight_decay, correct_bias, adam_mode):
    return {"count": np.int64(count), "alpha": np.float32(alpha), "beta": np.float32(beta),
            "epsilon": np.float32(epsilon), "weight_decay": np.float32(weight_decay),
            "correct_bias": np.int64(correct_bias), "adam_mode": np.int64(adam_mode)}


_ADAMW = Op("adamw_optimizer", shape=_adamw_shape, reference=_adamw_ref,
            batch=_batch_multi(3, 4, 3), target="jaxops_adamw_optimizer",
            ffi_attrs=_adamw_attrs, multiple_results=True, aliases=_aliases(3, (0, 2, 3)),
            factors=lambda *a, count, **p: _tensor_factors(a, 3, count, 4, (1, 3)))


# SGDOptimizerV2: operands (lr, signal, w..., g...) -> (flag, w...)
def _sgd_shape(lr, signal, *tensors, count):
    _one(lr, "lr", (jnp.float32,), "float32")
    _one(signal, "update_signal", (jnp.bool_,), "bool")
    lists = [tensors[:count], tensors[count:]]
    _check_lists(["weights", "gradients"], lists)
    return (jax.ShapeDtypeStruct(lr.shape, jnp.bool_),
            *[jax.ShapeDtypeStruct(w.shape, w.dtype) for w in lists[0]])


def _sgd_ref(lr, signal, *tensors, count):
    flag, w = ref.sgd_optimizer_v2(lr, list(tensors[:count]), list(tensors[count:]), signal)
    return (flag, *w)


_SGD_V2 = Op("sgd_optimizer_v2", shape=_sgd_shape, reference=_sgd_ref,
             batch=_batch_multi(2, 2, 1), target="jaxops_sgd_optimizer_v2",
             ffi_attrs=lambda *a, count: {"count": np.int64(count)}, multiple_results=True,
             aliases=_aliases(2, (0,)),
             factors=lambda *a, count: _tensor_factors(a, 2, count, 2, (0, 1)))


# LAMB: operands (signal, loss_scale, norm, R, step, hyper [count, 5], w..., g..., m1..., m2...)
#   -> (new_step, w..., new_g..., m1..., m2...), no new_g lists when new_gradients is 0; f32
#   weights and moments, one gradient dtype.
def _lamb_lists(new_gradients):
    """The operand lists that come back as results, in order."""
    return (0, 1, 2, 3) if new_gradients else (0, 2, 3)


def _lamb_shape(signal, loss_scale, norm, lr, step, hyper, *tensors, count, new_gradients,
                **attrs):
    _one(signal, "update_signal", (jnp.bool_,), "bool")
    for x, label in ((loss_scale, "loss_scale"), (norm, "gradient_norm"), (lr, "R")):
        _one(x, label, (jnp.float32,), "float32")
    _one(step, "step", rules.INDEX, "int64 (or int32)")
    if hyper.shape != (count, 5) or hyper.dtype != jnp.float32:
        raise ValueError(f"hyper must be float32 [{count}, 5], got {hyper.dtype}{hyper.shape}")
    lists = [tensors[k * count:(k + 1) * count] for k in range(4)]
    _check_lists(["weights", "gradients", "moment1", "moment2"], lists)
    if count and lists[0][0].dtype != jnp.float32:
        raise TypeError(f"the LAMB kernel takes float32 weights, got {lists[0][0].dtype}")
    return (jax.ShapeDtypeStruct(step.shape, step.dtype),
            *[jax.ShapeDtypeStruct(x.shape, x.dtype) for k in _lamb_lists(new_gradients)
              for x in lists[k]])


def _lamb_ref(signal, loss_scale, norm, lr, step, hyper, *tensors, count, ratio_min, ratio_max,
              do_bias_correction, has_step, has_norm, new_gradients):
    lists = [tensors[k * count:(k + 1) * count] for k in range(4)]
    groups = [(w, g, m1, m2, None) for w, g, m1, m2 in zip(*lists)]
    cols = [[hyper[i, k] for i in range(count)] for k in range(5)]
    new_step, outs = ref.lamb_optimizer(
        signal, loss_scale, norm if has_norm else None, lr, step if has_step else None, groups,
        alpha=cols[0], beta=cols[1], lambda_=cols[2], epsilon=cols[3], max_norm_clip=cols[4],
        ratio_min=ratio_min, ratio_max=ratio_max, do_bias_correction=do_bias_correction)
    if not has_step:
        new_step = step
    return (new_step, *[o[k] for k in _lamb_lists(new_gradients) for o in outs])


def _lamb_batch(op, args, dims, **params):
    # the trust ratio is a norm over the whole tensor: a batch dim cannot join the kernel's
    # tensors, so vmap runs the reference
    out = jax.vmap(lambda *a: op.reference(*a, **params), in_axes=tuple(dims))(*args)
    return out, (0,) * len(out)


def _lamb_factors(*args, count, new_gradients, **params):
    # norms need whole tensors: every tensor dim stays replicated
    f = _tensor_factors(args, 6, count, 4, (4, len(_lamb_lists(new_gradients))))
    return Factors(f.operands, f.results, tuple(dict.fromkeys(n for d in f.operands[6:] for n in d)))


_LAMB = Op("lamb_optimizer", shape=_lamb_shape, reference=_lamb_ref, batch=_lamb_batch,
           target="jaxops_lamb_optimizer", multiple_results=True,
           ffi_attrs=lambda *a, count, ratio_min, ratio_max, do_bias_correction, has_step,
           has_norm, new_gradients: {
               "count": np.int64(count), "ratio_min": np.float32(ratio_min),
               "ratio_max": np.float32(ratio_max),
               "do_bias_correction": np.int64(do_bias_correction),
               "has_step": np.int64(has_step), "has_norm": np.int64(has_norm),
               "new_gradients": np.int64(new_gradients)},
           aliases=lambda *a, new_gradients, **p: _aliases(6, _lamb_lists(new_gradients))(*a, **p),
           factors=_lamb_factors)


# ---- AdamWOptimizer, SGDOptimizerV2: the multi-tensor kernels -------------------------------

def _adamw_lists(weights, gradients, momentums_1, momentums_2):
    return [_as_list(x, n) for x, n in ((weights, "weights"), (gradients, "gradients"),
                                        (momentums_1, "momentums_1"),
                                        (momentums_2, "momentums_2"))]


def _adamw_check(lr, step, weights, gradients, momentums_1, momentums_2, update_signal, *,
                 alpha, beta, epsilon, weight_decay, correct_bias, adam_mode):
    lists = _adamw_lists(weights, gradients, momentums_1, momentums_2)
    _adamw_shape(lr, step, _signal(update_signal), *[x for xs in lists for x in xs],
                 count=len(lists[0]), correct_bias=correct_bias, adam_mode=adam_mode)


def _adamw_kernel(lr, step, weights, gradients, momentums_1, momentums_2, update_signal,
                  **attrs):
    lists = _adamw_lists(weights, gradients, momentums_1, momentums_2)
    hyper = {k: attrs[k] for k in ("alpha", "beta", "epsilon", "weight_decay")}
    static = {k: _concrete(v) for k, v in hyper.items()}
    if None in static.values():  # traced: XLA code
        return _adamw_reference(lr, step, *lists, update_signal, **attrs)
    count = len(lists[0])
    out = _ADAMW.bind(lr, step, _signal(update_signal), *[x for xs in lists for x in xs],
                      count=count, correct_bias=attrs["correct_bias"],
                      adam_mode=attrs["adam_mode"], **static)
    return (out[0], list(out[1:1 + count]), list(out[1 + count:1 + 2 * count]),
            list(out[1 + 2 * count:]))


def _adamw_reference(lr, step, weights, gradients, momentums_1, momentums_2, update_signal,
                     **attrs):
    lists = _adamw_lists(weights, gradients, momentums_1, momentums_2)
    flag, w, m1, m2 = ref.adamw_optimizer(lr, step, *lists, _signal(update_signal), **attrs)
    return flag, w, m1, m2


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def _optimizer_lists(rng, shape, dtype):
    """Two tensors (of `shape` and of its first dim): weights, gradients, moments. The second
    moments stay away from 0, where 1/sqrt(m2) curves too fast for finite differences."""
    shapes = (shape, shape[:1])
    w = [_normal(rng, s, dtype) for s in shapes]
    g = [_normal(rng, s, dtype) for s in shapes]
    m1 = [_normal(rng, s, dtype, 0.1) for s in shapes]
    m2 = [jnp.asarray(0.5 + np.abs(0.1 * rng.standard_normal(s)), dtype) for s in shapes]
    return w, g, m1, m2


_LR = lambda rng: jnp.asarray([rng.uniform(0.01, 0.1)], jnp.float32)  # noqa: E731
_LISTS_SKIP = ("the lists (ORT sequences) are not arrays the harness can stack or shard; "
               "tests/test_optim.py runs vmap (every list batched or not, lr and step) and "
               "sharded lists")

# lr is kind "array": ORT takes float32 only, which the shape rule says ("lr must be float32")
adamw_optimizer = define(
    "adamw_optimizer", ort=(_MS, "AdamWOptimizer"),
    inputs=("lr", "step: index", "weights: any", "gradients: any", "momentums_1: any",
            "momentums_2: any", "update_signal?: bool"),
    outputs=("updated_flag", "updated_weights", "updated_momentums_1", "updated_momentums_2"),
    attrs={"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8, "weight_decay": 0.01,
           "correct_bias": 1, "adam_mode": 0},
    check=_adamw_check, kernel=_adamw_kernel, reference=_adamw_reference,
    in_place={2: 1, 4: 2, 5: 3},
    roles={"lr": "lr", "step": "step", "params": "weights", "grads": "gradients",
           "moments": ("momentums_1", "momentums_2")},
    doc="""ORT AdamWOptimizer over lists of tensors: (updated_flag, weights, momentums_1,
    momentums_2).

    `step` is used as given: ORT's step is 1-based and the op does NOT increment it (the caller
    does); step 0 with correct_bias=1 divides by zero (NaN), as in ORT. correct_bias=0 needs
    adam_mode 1 (ORT refuses it with mode 0). adam_mode 0 is
    PyTorch's AdamW (decay w by lr*weight_decay first, bias-corrected denominator
    sqrt(m2)/sqrt(1-beta^step) + eps); adam_mode 1 is HuggingFace's (step size
    lr*sqrt(1-beta^step)/(1-alpha^step), eps added to the uncorrected sqrt(m2), decay applied
    last). update_signal False leaves everything unchanged and returns flag False; the flag
    has step's shape. lr: one float32; step: one int64 (int32 accepted, as JAX without x64
    has no int64). Weights and moments share a dtype (f16/bf16/f32/f64); gradients have it too,
    or are f16/bf16 with f32 weights. Math in f32 (f64 for f64). The weight and moment lists
    alias their inputs (donate them to update in place). alpha, beta, epsilon and weight_decay
    may be traced scalars (jit arguments, optax.inject_hyperparams): the kernel takes them as
    attributes, so such a call runs the reference as XLA code (same math, no kernel).
    """,
    matrix=Matrix(lambda rng, shape, dtype: (_LR(rng), jnp.asarray([3], jnp.int32),
                                             *_optimizer_lists(rng, shape, dtype)),
                  grad=(2, 3, 4, 5), vmap=False, shard=False, skip=_LISTS_SKIP))


def _sgd_lists(weights, gradients):
    return _as_list(weights, "weights"), _as_list(gradients, "gradients")


def _sgd_check(lr, weights, gradients, update_signal):
    w, g = _sgd_lists(weights, gradients)
    _sgd_shape(lr, _signal(update_signal), *w, *g, count=len(w))


def _sgd_kernel(lr, weights, gradients, update_signal):
    w, g = _sgd_lists(weights, gradients)
    out = _SGD_V2.bind(lr, _signal(update_signal), *w, *g, count=len(w))
    return out[0], list(out[1:])


def _sgd_reference(lr, weights, gradients, update_signal):
    return ref.sgd_optimizer_v2(lr, *_sgd_lists(weights, gradients), _signal(update_signal))


sgd_optimizer_v2 = define(
    "sgd_optimizer_v2", ort=(_MS, "SGDOptimizerV2"),
    inputs=("lr", "weights: any", "gradients: any", "update_signal?: bool"),
    outputs=("update_completed", "updated_weights"),
    check=_sgd_check, kernel=_sgd_kernel, reference=_sgd_reference, in_place={1: 1},
    roles={"lr": "lr", "step": None, "params": "weights", "grads": "gradients", "moments": ()},
    doc="""ORT SGDOptimizerV2 over lists of tensors: (update_completed, weights), w -= lr * g.

    update_signal False leaves the weights unchanged and returns False; the flag has lr's shape.
    lr: one float32. Gradients have the weights' dtype, or f16/bf16 with f32 weights. The
    weights alias their inputs (donate them to update in place).
    """,
    matrix=Matrix(lambda rng, shape, dtype: (_LR(rng), *_optimizer_lists(rng, shape, dtype)[:2]),
                  grad=(1, 2), vmap=False, shard=False, skip=_LISTS_SKIP))


# ---- single-tensor and norm-based ops: XLA code ---------------------------------------------

def _sgd_optimizer_check(ETA, W, G):
    _one(ETA, "ETA", rules.FLOATS, "a float")
    _check_lists(["W", "G"], [[W], [G]])


sgd_optimizer = define(
    "sgd_optimizer", ort=(_MS, "SGDOptimizer"), inputs=("ETA: float", "W: float", "G: float"),
    outputs=("NW", "NG"), check=_sgd_optimizer_check, reference=ref.sgd_optimizer,
    doc="""ORT SGDOptimizer (legacy, one tensor): (NW, NG) = (W - ETA*G, -ETA*G).

    XLA code: one elementwise fusion, which a kernel would not beat.
    """,
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, (1,), dtype), _normal(rng, shape, dtype),
                                             _normal(rng, shape, dtype)), grad=(0, 1, 2)))


def _mixed_precision_copy(mpw, w):
    if mpw is not None and (mpw.dtype not in (jnp.float16, jnp.bfloat16)
                            or mpw.shape != w.shape):
        raise TypeError("mixed_precision_weights must be f16/bf16 of the weights' shape")


def _adam_check(R, T, weights, gradients, moment_1, moment_2, mixed_precision_weights,
                loss_scale, global_gradient_norm, update_signal, **attrs):
    _attributes({k: v for k, v in attrs.items() if k not in _ADAM_ATTRS})
    _one(R, "R", rules.FLOATS, "a float")
    _one(T, "T", rules.INDEX, "int64 (or int32)")
    _check_lists(["weights", "gradients", "moment_1", "moment_2"],
                 [[weights], [gradients], [moment_1], [moment_2]])
    _mixed_precision_copy(mixed_precision_weights, weights)
    if update_signal is not None:
        rules.flag("update_signal", update_signal)


def _adam_reference(R, T, weights, gradients, moment_1, moment_2, mixed_precision_weights,
                    loss_scale, global_gradient_norm, update_signal, **attrs):
    lam = attrs.pop("lambda", 0.0)
    return ref.adam_optimizer(R, T, weights, gradients, moment_1, moment_2,
                              mixed_precision_weights, loss_scale, global_gradient_norm,
                              update_signal, lambda_=lam, **attrs)


_ADAM_ATTRS = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8, "max_norm_clip": 1.0,
               "do_bias_correction": 1, "weight_decay_mode": 0}


def _adam_inputs(rng, shape, dtype):
    w, g, m1, m2 = (x[0] for x in _optimizer_lists(rng, shape, dtype))
    return _normal(rng, (1,), dtype, 0.1), jnp.asarray([3], jnp.int32), w, g, m1, m2


adam_optimizer = define(
    "adam_optimizer", ort=(_MS, "AdamOptimizer"),
    inputs=("R: float", "T: index", "weights: float", "gradients: float", "moment_1: float",
            "moment_2: float", "mixed_precision_weights?: float", "loss_scale?: float",
            "global_gradient_norm?: float", "update_signal?: bool"),
    outputs=("new_T", "new_moment_1", "new_moment_2", "new_weights", "new_gradients",
             "new_mixed_precision_weights"),
    attrs=_ADAM_ATTRS, extra_attrs=True, check=_adam_check, reference=_adam_reference,
    doc="""ORT AdamOptimizer (legacy, one tensor): (new_T, new_moment_1, new_moment_2,
    new_weights, new_gradients, new_mixed_precision_weights or None). `lambda` (default 0) is
    a Python keyword: pass it as **{"lambda": v}.

    CUDA semantics: g = gradients / s with s the loss scale, or global_gradient_norm /
    max_norm_clip when norm / loss_scale > max_norm_clip; bias corrections 1 - alpha^T,
    1 - beta^T for T > 0 (T as given), and new_T = T + 1. new_gradients is the applied delta.
    update_signal False passes everything through and does not increment T. (ORT's CPU kernel
    ignores loss_scale, the norm and update_signal.)
    XLA code: one elementwise fusion per tensor, which a kernel would not beat.
    """,
    matrix=Matrix(_adam_inputs, attrs={"lambda": 0.01}, grad=(0, 2, 3, 4, 5), shard=False,
                  skip="the first output is the one-element step count new_T, which the harness "
                       "would find unsharded; tests/test_optim.py checks sharded tensors"))


# ---- LambOptimizer ------------------------------------------------------------------------

def _per_group(value, n, name):
    value = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(value) < n:
        raise ValueError(f"{name} has {len(value)} values for {n} groups")
    return [v if _concrete(v) is None else float(v) for v in value[:n]]


def _hyper(columns):
    """The LAMB kernel's [groups, 5] f32 operand; traced values (jit arguments) join it too."""
    if all(isinstance(v, float) for col in columns for v in col):
        return jnp.asarray(np.stack(columns, axis=1).astype(np.float32))
    return jnp.stack([jnp.stack([jnp.asarray(v, jnp.float32) for v in col]) for col in columns],
                     axis=1)


def _lamb_groups(groups):
    """ORT's variadic inputs, 5 per group (a missing last mixed-precision copy is None)."""
    groups = list(groups)
    if len(groups) % 5 == 4:
        groups.append(None)
    conv = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    return [tuple(conv(x) for x in groups[i:i + 5]) for i in range(0, len(groups), 5)]


def _lamb_hyper(n, alpha, beta, epsilon, max_norm_clip, attributes):
    lam = _attributes(attributes)
    return [_per_group(v, n, name) for v, name in
            ((alpha, "alpha"), (beta, "beta"), (lam, "lambda"), (epsilon, "epsilon"),
             (max_norm_clip, "max_norm_clip"))]


def _lamb_check(update_signal, loss_scale, gradient_norm, R, step, *groups, alpha, beta,
                epsilon, max_norm_clip, ratio_min, ratio_max, do_bias_correction,
                new_gradients, **attributes):
    groups = _lamb_groups(groups)
    if any(x is None for g in groups for x in g[:4]):
        raise ValueError("every group needs weights, gradients, moment1 and moment2")
    if R is None:
        raise ValueError("R (the learning rate) is required")
    _one(R, "R", rules.FLOATS, "a float")
    if step is not None:
        _one(step, "step", rules.INDEX, "int64 (or int32)")
    if update_signal is not None:
        rules.flag("update_signal", update_signal)
    for w, g, m1, m2, mpw in groups:
        _check_lists(["weights", "gradients", "moment1", "moment2"], [[w], [g], [m1], [m2]])
        _mixed_precision_copy(mpw, w)
    _lamb_hyper(len(groups), alpha, beta, epsilon, max_norm_clip, attributes)


def _lamb_reference(update_signal, loss_scale, gradient_norm, R, step, *groups, alpha, beta,
                    epsilon, max_norm_clip, ratio_min, ratio_max, do_bias_correction,
                    new_gradients, **attributes):
    groups = _lamb_groups(groups)
    al, be, la, ep, mx = _lamb_hyper(len(groups), alpha, beta, epsilon, max_norm_clip,
                                     attributes)
    new_step, outs = ref.lamb_optimizer(
        update_signal, loss_scale, gradient_norm, R, step, groups, alpha=al, beta=be,
        lambda_=la, epsilon=ep, max_norm_clip=mx, ratio_min=ratio_min, ratio_max=ratio_max,
        do_bias_correction=do_bias_correction)
    keep = (True, bool(new_gradients), True, True, True)
    return (new_step, *[x if k else None for group in outs for x, k in zip(group, keep)])


def _lamb_fast(update_signal, loss_scale, gradient_norm, R, step, *groups, ratio_min,
               ratio_max, do_bias_correction, new_gradients, **hyper):
    """The kernel where it fits (f32 weights and moments, one gradient dtype, concrete
    ratio_min/ratio_max: kernel attributes), else the reference."""
    kw = dict(ratio_min=ratio_min, ratio_max=ratio_max, do_bias_correction=do_bias_correction,
              new_gradients=new_gradients)
    groups = _lamb_groups(groups)
    static_ratios = None not in (_concrete(ratio_min), _concrete(ratio_max))
    if not (static_ratios and _lamb_kernel_fits(groups, R, loss_scale, gradient_norm)):
        return _lamb_reference(update_signal, loss_scale, gradient_norm, R, step,
                               *[x for g in groups for x in g], **kw, **hyper)
    attributes = {k: v for k, v in hyper.items()
                  if k not in ("alpha", "beta", "epsilon", "max_norm_clip")}
    columns = _lamb_hyper(len(groups), hyper["alpha"], hyper["beta"], hyper["epsilon"],
                          hyper["max_norm_clip"], attributes)
    return _lamb_kernel(update_signal, loss_scale, gradient_norm, R, step, groups,
                        _hyper(columns), new_gradients=bool(new_gradients),
                        ratio_min=ratio_min, ratio_max=ratio_max,
                        do_bias_correction=do_bias_correction)


def _lamb_kernel_fits(groups, *scalars):
    """The kernel takes f32 weights and moments and one gradient dtype for all groups."""
    if not groups or any(x is not None and x.dtype == jnp.float64 for x in scalars):
        return False
    g_types = {g[1].dtype for g in groups}
    return (all(x.dtype == jnp.float32 for g in groups for x in (g[0], g[2], g[3]))
            and len(g_types) == 1 and g_types <= set(rules.FLOATS[:3]))


def _lamb_kernel(signal, loss_scale, norm, R, step, groups, hyper, new_gradients, **kw):
    count = len(groups)
    f32 = lambda x, default: jnp.reshape(jnp.asarray(default if x is None else x, jnp.float32), (1,))  # noqa: E731
    step_in = jnp.zeros((1,), jnp.int32) if step is None else step
    out = _LAMB.bind(_signal(signal), f32(loss_scale, 1.0), f32(norm, 0.0), f32(R, 0.0), step_in,
                     jnp.asarray(hyper), *[g[k] for k in range(4) for g in groups], count=count,
                     has_step=int(step is not None), has_norm=int(norm is not None),
                     new_gradients=int(new_gradients), **kw)
    new_step = None if step is None else out[0]
    lists = [[None] * count for _ in range(4)]
    for j, k in enumerate(_lamb_lists(new_gradients)):
        lists[k] = out[1 + j * count:1 + (j + 1) * count]
    flat = []
    for i, (w, g, m1, m2, mpw) in enumerate(groups):
        new_mpw = None
        if mpw is not None:  # the low-precision copy follows the updated weights
            new_mpw = jnp.where(_signal(signal).reshape(()), lists[0][i].astype(mpw.dtype), mpw)
        flat += [lists[0][i], lists[1][i], lists[2][i], lists[3][i], new_mpw]
    return (new_step, *flat)


def _lamb_graph(ctx, *inputs):
    """LambOptimizer writes new gradients only where the graph names one (output 2 + 5i)."""
    return {"new_gradients": any(ctx.output_used(i) for i in range(2, ctx.num_outputs, 5))}


lamb_optimizer = define(
    "lamb_optimizer", ort=(_MS, "LambOptimizer"),
    inputs=("update_signal?: bool", "loss_scale?: float", "gradient_norm?: float", "R?: float",
            "step?: index", "*groups?: any"),
    outputs=("new_step", "*groups"),
    attrs={"alpha": 0.9, "beta": 0.999, "epsilon": 1e-6, "max_norm_clip": 1.0,
           "ratio_min": -np.inf, "ratio_max": np.inf, "do_bias_correction": 1},
    options={"new_gradients": True}, extra_attrs=True, graph=_lamb_graph,
    check=_lamb_check, kernel=_lamb_fast, reference=_lamb_reference,
    doc="""ORT LambOptimizer. `groups` are ORT's variadic inputs, 5 per group: weights,
    gradients, moment1, moment2, mixed_precision_weights (None when absent). Per-group
    attributes (alpha, beta, lambda, epsilon, max_norm_clip) are lists (a scalar applies to
    every group); `lambda` (default 0) is a Python keyword: pass it as **{"lambda": v}.
    Returns (new_step or None, then per group new_weights, new_gradients, new_moment_1,
    new_moment_2, new_mixed_precision_weights or None). new_gradients=False (not an ORT
    attribute: the importer sets it when the graph leaves every new_gradients output out)
    returns None for them, and the kernel does not write them.

    Per group: g /= s (as AdamOptimizer); m1, m2 as Adam; d = lambda*w + (m1/ac)/(sqrt(m2/bc)+eps)
    with ac, bc from step (1 when step is absent or <= 0, or without bias correction). Where d
    is not finite it is 0 and the moments keep their old values. The trust ratio is
    R * clip(||w|| / ||d||, ratio_min, ratio_max), or R when either norm is 0; w -= ratio*d,
    except where that is not finite (w kept, new gradient 0); new_gradients is the applied
    delta. new_step = step + 1 (when step is given). update_signal False passes everything
    through and keeps step.
    f32 weights and moments with one gradient dtype (f32/f16/bf16) for all groups run the
    multi-tensor kernel (one launch: per-chunk norm partials, then the update; deterministic);
    other dtype mixes, and vmap, run the reference as XLA code. Sharded tensors are gathered:
    the trust ratio needs each tensor's whole norm. The per-group attributes may be traced
    scalars (they reach the kernel as an operand); traced ratio_min/ratio_max (kernel
    attributes) run the reference.
    """,
    no_matrix="the kernel takes f32 weights only and the matrix's JAXOPS_DISABLE check runs "
              "f64 inputs (no kernel then) at 1e-9; vmap runs the reference and sharded "
              "tensors are gathered (the trust ratio needs whole norms): tests/test_optim.py "
              "checks the kernel against the reference, jit, donation, vmap and sharding")


# ---- InplaceClipGradNorm ------------------------------------------------------------------

def _clip_check(gradients, *, max_norm, norm_type):
    gradients = _as_list(gradients, "gradients")
    if norm_type != "fro":
        raise ValueError(f"norm_type must be 'fro', got {norm_type!r}")
    if gradients:
        _check_lists(["gradients"], [gradients], grads_index=None)


inplace_clip_grad_norm = define(
    "inplace_clip_grad_norm", ort=(_MS, "InplaceClipGradNorm"), inputs=("gradients: any",),
    outputs=("clipped_gradients",), attrs={"max_norm": 1.0, "norm_type": "fro"},
    check=_clip_check, in_place={0: 0},
    reference=lambda gradients, *, max_norm, norm_type: ref.inplace_clip_grad_norm(
        _as_list(gradients, "gradients"), max_norm=max_norm),
    doc="""ORT InplaceClipGradNorm: every gradient times min(max_norm / (total_norm + 1e-6), 1),
    total_norm the L2 norm over all of them (computed in f32, f64 for f64). Returns the list.
    XLA code (a reduction per tensor and one scale each).
    """,
    matrix=Matrix(lambda rng, shape, dtype: (_optimizer_lists(rng, shape, dtype)[1],),
                  grad=(0,), vmap=False, shard=False,
                  skip="the gradients are a list (an ORT sequence), which the harness cannot "
                       "stack or shard; tests/test_optim.py runs vmap and a sharded list"))
