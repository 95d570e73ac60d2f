"""optax-compatible optimizers backed by jaxops' fused ORT optimizer kernels.

Each constructor returns an `optax.GradientTransformation` (init/update, usable in
`optax.chain` and with `optax.apply_updates`) that also has a `step(grads, state, params) ->
(new_params, new_state)` method: the fused path, which hands the parameter and moment
buffers to the kernel, so under `jax.jit(..., donate_argnums=...)` they are updated in place
with one kernel launch per dtype of the parameter tree (a bf16 + f32 tree: two).

`update` returns `new_params - params`, as optax expects, computed by the ops' pure-JAX
definitions (`ops.<op>.reference`): XLA fuses that with `optax.apply_updates` into one pass
over the buffers, as it does optax's own code, while a kernel's output would need two more
passes (the difference, then the addition). Measured on an H100 (docs/performance.md,
"Optimizer API paths"): `step` is the fastest path; `update` runs at optax's speed.

Semantics against optax (equal to f32 rounding where they coincide):
- `adamw`/`adam`: optax.adamw/adam exactly (ORT adam_mode 0, bias-corrected, with optax's
  step count + 1 as ORT's 1-based step); eps_root, mu_dtype, mask and nesterov are not
  supported. ORT's adam_mode 1 (HuggingFace: eps added to the uncorrected sqrt(m2), decay
  applied after the Adam step) is available as `adamw(..., hf_mode=True)` and differs from optax.
- `sgd`: optax.sgd without momentum.
- `lamb`: optax.lamb when ratio_min/ratio_max are left at -inf/+inf; ORT clamps the trust
  ratio to [ratio_min, ratio_max] when given, and zeroes non-finite directions (keeping the
  moments) where optax propagates them.
- Hyperparameters may be traced scalars (jit arguments; `optax.inject_hyperparams`, which
  makes every numeric argument one, and whose wrapper has `update` only). The learning rate
  reaches the `step` kernels as an operand; b1, b2, eps and weight_decay are static attributes
  of the AdamW kernel, so in `step` a traced one runs that step as XLA code (the reference:
  same math, no kernel). LAMB's kernel takes them as an operand; its ratio_min/ratio_max are
  attributes.
- `clip_by_global_norm`: ORT's InplaceClipGradNorm scales by min(max_norm/(norm + 1e-6), 1);
  optax by max_norm/max(norm, max_norm): they differ by about 1e-6 relative when clipping.
"""
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxops import ops

__all__ = ["FusedGradientTransformation", "AdamState", "LambState", "adamw", "adam", "lamb",
           "sgd", "clip_by_global_norm"]


class FusedGradientTransformation(optax.GradientTransformation):
    """An optax GradientTransformation with a fused `step(grads, state, params) ->
    (new_params, new_state)`."""

    def step(self, grads, state, params):
        return self.update.fused_step(grads, state, params)


def _kernel(op):
    return op


def _xla(op):
    return op.reference


def _transformation(init, step):
    """step(run, grads, state, params): the optimizer written once, over `run(op)`: the op's
    kernel-backed function (`_kernel`) or its pure-JAX definition (`_xla`)."""
    def update(grads, state, params=None):
        if params is None:
            raise ValueError("jaxops.optim: this optimizer needs params in update()")
        new_params, new_state = step(_xla, grads, state, params)
        return jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_params, params), new_state
    update.fused_step = functools.partial(step, _kernel)
    return FusedGradientTransformation(init, update)


class AdamState(NamedTuple):
    count: jax.Array  # int32: steps taken
    mu: Any
    nu: Any


class LambState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any


def _lr(learning_rate, count):
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    return jnp.reshape(jnp.asarray(lr, jnp.float32), (1,))


def _increment(count):
    """The step count + 1, saturating at its dtype's max as optax's count does. XLA keeps the
    select as one op that the step and the new state both read, so the donated count is read
    once, then overwritten; a plain `count + 1` was recomputed inside each reader, and XLA
    copied the donated count to keep it for them (one more op a step, seen on XLA:CPU)."""
    top = jnp.iinfo(count.dtype).max
    return jnp.where(count < top, count + 1, top)


def _by_dtype(lists):
    """Tensor indices grouped by their dtypes across the lists (weights, gradients, moments),
    in first-seen order: each kernel launch takes one weight dtype (bf16 and f32 leaves of one
    tree step in two launches)."""
    groups = {}
    for i, dtypes in enumerate(zip(*[[x.dtype for x in xs] for xs in lists])):
        groups.setdefault(dtypes, []).append(i)
    return list(groups.values())


def _pick(xs, idx):
    return [xs[i] for i in idx]


def _moments_init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return jnp.zeros([], jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params)


def adamw(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          *, weight_decay: float = 1e-4, hf_mode: bool = False) -> FusedGradientTransformation:
    """optax.adamw through ORT's AdamWOptimizer kernel (adam_mode 0; 1 with hf_mode)."""
    def init(params):
        return AdamState(*_moments_init(params))

    def fused_step(run, grads, state, params):
        leaves, tree = jax.tree.flatten(params)
        lists = [leaves] + [tree.flatten_up_to(t) for t in (grads, state.mu, state.nu)]
        count = _increment(state.count)
        lr, step = _lr(learning_rate, state.count), jnp.reshape(count, (1,))
        new = [list(leaves), list(lists[2]), list(lists[3])]  # w, m1, m2
        for idx in _by_dtype(lists):
            _, *outs = run(ops.adamw_optimizer)(
                lr, step, *[_pick(xs, idx) for xs in lists], alpha=b1, beta=b2, epsilon=eps,
                weight_decay=weight_decay, correct_bias=1, adam_mode=int(hf_mode))
            for target, out in zip(new, outs):
                for i, x in zip(idx, out):
                    target[i] = x
        new_state = AdamState(count, tree.unflatten(new[1]), tree.unflatten(new[2]))
        return tree.unflatten(new[0]), new_state

    return _transformation(init, fused_step)


def adam(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8) -> FusedGradientTransformation:
    """optax.adam through ORT's AdamWOptimizer kernel (no weight decay)."""
    return adamw(learning_rate, b1, b2, eps, weight_decay=0.0)


def sgd(learning_rate: float | Callable, momentum: float | None = None,
        nesterov: bool = False) -> FusedGradientTransformation:
    """optax.sgd (no momentum) through ORT's SGDOptimizerV2 kernel; as optax's, the state
    counts steps only for a schedule (a constant rate: no state, no buffer to pass a call)."""
    if momentum is not None or nesterov:
        raise NotImplementedError("jaxops.optim.sgd: ORT's SGD has no momentum")
    scheduled = callable(learning_rate)

    def init(params):
        if scheduled:
            return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))
        return optax.EmptyState()

    def fused_step(run, grads, state, params):
        leaves, tree = jax.tree.flatten(params)
        lr = _lr(learning_rate, state.count if scheduled else None)
        lists = [leaves, tree.flatten_up_to(grads)]
        new = list(leaves)
        for idx in _by_dtype(lists):
            _, w = run(ops.sgd_optimizer_v2)(lr, *[_pick(xs, idx) for xs in lists])
            for i, x in zip(idx, w):
                new[i] = x
        if scheduled:
            state = optax.ScaleByScheduleState(count=_increment(state.count))
        return tree.unflatten(new), state

    return _transformation(init, fused_step)


def lamb(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         *, weight_decay: float = 0.0, ratio_min: float = -float("inf"),
         ratio_max: float = float("inf")) -> FusedGradientTransformation:
    """optax.lamb through ORT's LambOptimizer (one group per parameter tensor, each with its
    own trust ratio, as optax)."""
    def init(params):
        return LambState(*_moments_init(params))

    def fused_step(run, grads, state, params):
        leaves, tree = jax.tree.flatten(params)
        groups = []
        for w, g, m1, m2 in zip(leaves, tree.flatten_up_to(grads), tree.flatten_up_to(state.mu),
                                tree.flatten_up_to(state.nu)):
            groups += [w, g, m1, m2, None]
        n, count = len(leaves), _increment(state.count)
        out = run(ops.lamb_optimizer)(
            None, None, None, _lr(learning_rate, state.count), jnp.reshape(count, (1,)),
            *groups, alpha=[b1] * n, beta=[b2] * n, epsilon=[eps] * n, max_norm_clip=[1.0] * n,
            ratio_min=ratio_min, ratio_max=ratio_max, do_bias_correction=1,
            new_gradients=False, **{"lambda": [weight_decay] * n})
        per = [out[1 + 5 * i:6 + 5 * i] for i in range(n)]
        new_state = LambState(count, tree.unflatten([p[2] for p in per]),
                              tree.unflatten([p[3] for p in per]))
        return tree.unflatten([p[0] for p in per]), new_state

    return _transformation(init, fused_step)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Gradient clipping as ORT's InplaceClipGradNorm: g * min(max_norm/(norm + 1e-6), 1)."""
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None):
        leaves, tree = jax.tree.flatten(updates)
        return tree.unflatten(ops.inplace_clip_grad_norm(leaves, max_norm=max_norm)), state

    return optax.GradientTransformation(init, update)
