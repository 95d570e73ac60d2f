"""Pure-JAX references of ORT's optimizers and mixed-precision/scaling ops.

Written from the spec (`ort-training-ops.md`, Optimizers; Mixed precision / scaling). Math runs
in f32 (f64 for f64 inputs); results are cast back to their input's dtype. Sequence inputs are
lists; results are returned as ORT orders them (lists for sequence outputs).
"""
import jax
import jax.numpy as jnp

from jaxops.reference.scaling import acc_dtype


def _up(x, like=None):
    return x.astype(acc_dtype(x.dtype if like is None else like))


def _signal(update_signal):
    return True if update_signal is None else jnp.reshape(update_signal, ()).astype(bool)


def _scalar(x):
    return jnp.reshape(x, ())


def _keep_if(signal, new, old):
    return jnp.where(signal, new, old).astype(old.dtype)


def adamw_optimizer(lr, step, weights, gradients, momentums_1, momentums_2, update_signal=None,
                    *, alpha=0.9, beta=0.999, epsilon=1e-8, weight_decay=0.01, correct_bias=1,
                    adam_mode=0):
    """AdamWOptimizer: (flag, weights, m1, m2). step is used as given (1-based)."""
    signal = _signal(update_signal)
    new_w, new_m1, new_m2 = [], [], []
    for w, g, m1, m2 in zip(weights, gradients, momentums_1, momentums_2):
        a = acc_dtype(w.dtype)
        # ORT's attributes are float32: round them as the kernels receive them
        # (jnp rather than np: the values may be traced)
        al, be, ep, wd = (jnp.asarray(v, jnp.float32).astype(a)
                          for v in (alpha, beta, epsilon, weight_decay))
        r = _scalar(lr).astype(a)
        s = _scalar(step).astype(a)
        bias1 = 1 - al ** s if correct_bias else jnp.asarray(1, a)
        bias2 = 1 - be ** s if correct_bias else jnp.asarray(1, a)
        wv, gv, m1v, m2v = _up(w), g.astype(a), _up(m1), _up(m2)
        if adam_mode == 0:
            wv = wv - r * wd * wv
        m1n = al * m1v + (1 - al) * gv
        m2n = be * m2v + (1 - be) * gv * gv
        if adam_mode == 0:
            wv = wv - (r / bias1) * (m1n / (jnp.sqrt(m2n) / jnp.sqrt(bias2) + ep))
        else:
            wv = wv - (r * jnp.sqrt(bias2) / bias1) * (m1n / (jnp.sqrt(m2n) + ep))
            wv = jnp.where(wd > 0, wv - r * wd * wv, wv)  # (no decay: inf weights stay inf)
        new_w.append(_keep_if(signal, wv, w))
        new_m1.append(_keep_if(signal, m1n, m1))
        new_m2.append(_keep_if(signal, m2n, m2))
    flag = jnp.broadcast_to(jnp.asarray(signal), jnp.shape(step))
    return flag, new_w, new_m1, new_m2


def sgd_optimizer_v2(lr, weights, gradients, update_signal=None):
    """SGDOptimizerV2: (flag of lr's shape, weights)."""
    signal = _signal(update_signal)
    new_w = []
    for w, g in zip(weights, gradients):
        new = _up(w) - _scalar(lr).astype(acc_dtype(w.dtype)) * g.astype(acc_dtype(w.dtype))
        new_w.append(_keep_if(signal, new, w))
    return jnp.broadcast_to(jnp.asarray(signal), jnp.shape(lr)), new_w


def sgd_optimizer(eta, w, g):
    """SGDOptimizer: (W - ETA*G, -ETA*G)."""
    a = acc_dtype(w.dtype)
    delta = -_scalar(eta).astype(a) * g.astype(a)
    return (_up(w) + delta).astype(w.dtype), delta.astype(g.dtype)


def grad_scale(loss_scale, gradient_norm, max_norm_clip, a):
    """ORT's gradient divisor: the loss scale, or norm / max_norm_clip when the unscaled norm
    exceeds max_norm_clip."""
    s = jnp.asarray(1, a) if loss_scale is None else _scalar(loss_scale).astype(a)
    if gradient_norm is None:
        return s
    norm = _scalar(gradient_norm).astype(a)
    return jnp.where(norm / s > max_norm_clip, norm / jnp.asarray(max_norm_clip, a), s)


def bias_correction(coef, step, a):
    """1 - coef^step for step > 0, else 1."""
    s = _scalar(step).astype(a)
    return jnp.where(s > 0, 1 - jnp.asarray(coef, a) ** s, 1)


def adam_optimizer(R, T, weights, gradients, moment_1, moment_2, mixed_precision_weights=None,
                   loss_scale=None, global_gradient_norm=None, update_signal=None, *, alpha=0.9,
                   beta=0.999, lambda_=0.0, epsilon=1e-8, max_norm_clip=1.0,
                   do_bias_correction=1, weight_decay_mode=0):
    """AdamOptimizer (legacy, one tensor): (new_T, new_m1, new_m2, new_weights,
    new_gradients, new_mixed_precision_weights or None)."""
    signal = _signal(update_signal)
    a = acc_dtype(weights.dtype)
    g = gradients.astype(a) / grad_scale(loss_scale, global_gradient_norm, max_norm_clip, a)
    al, be, ep, lam = (jnp.asarray(v, a) for v in (alpha, beta, epsilon, lambda_))
    r = _scalar(R).astype(a)
    m1 = al * _up(moment_1, a) + (1 - al) * g
    m2 = be * _up(moment_2, a) + (1 - be) * g * g
    ac = bias_correction(alpha, T, a) if do_bias_correction else jnp.asarray(1, a)
    bc = bias_correction(beta, T, a) if do_bias_correction else jnp.asarray(1, a)
    w = _up(weights)
    if weight_decay_mode == 0:
        delta = -r * ((m1 / ac) / (jnp.sqrt(m2 / bc) + ep) + lam * w)
    else:
        update = (r * jnp.sqrt(bc) / ac) * m1 / (jnp.sqrt(m2) + ep)
        delta = -update - r * lam * (w - update)
    new_w = _keep_if(signal, w + delta, weights)
    new_t = jnp.where(signal, T + 1, T).astype(T.dtype)
    mpw = None
    if mixed_precision_weights is not None:
        mpw = _keep_if(signal, new_w.astype(mixed_precision_weights.dtype),
                       mixed_precision_weights)
    return (new_t, _keep_if(signal, m1, moment_1), _keep_if(signal, m2, moment_2), new_w,
            _keep_if(signal, delta, gradients), mpw)


def _norm(x):
    return jnp.sqrt(jnp.sum(x * x))


def _barrier_all(*values):
    return jax.lax.optimization_barrier(values)


def _barrier_but_last(*values):
    """The update's delta left out: XLA:GPU recomputed it from the old moments after their
    buffers were overwritten, and copied the moments first (through the barrier it is kept in
    memory instead: half the traffic); XLA:CPU fuses it better recomputed."""
    return (*jax.lax.optimization_barrier(values[:-1]), values[-1])


def lamb_optimizer(update_signal, loss_scale, gradient_norm, R, step, groups, *, alpha, beta,
                   lambda_, epsilon, max_norm_clip, ratio_min=-jnp.inf, ratio_max=jnp.inf,
                   do_bias_correction=1):
    """LambOptimizer. groups: list of (w, g, m1, m2, mixed_precision_w or None); the per-group
    attributes are lists. Returns (new_step or None, [(w, g, m1, m2, mpw or None), ...])."""
    signal = _signal(update_signal)
    out = []
    for i, (w, g, m1, m2, mpw) in enumerate(groups):
        a = acc_dtype(w.dtype)
        s = grad_scale(loss_scale, gradient_norm, max_norm_clip[i], a)
        gv = g.astype(a) / s
        al, be, ep, lam = (jnp.asarray(v[i], a) for v in (alpha, beta, epsilon, lambda_))
        m1n = al * _up(m1, a) + (1 - al) * gv
        m2n = be * _up(m2, a) + (1 - be) * gv * gv
        if do_bias_correction and step is not None:
            ac, bc = bias_correction(alpha[i], step, a), bias_correction(beta[i], step, a)
        else:
            ac = bc = jnp.asarray(1, a)
        wv = _up(w)
        d = lam * wv + (m1n / ac) / (jnp.sqrt(m2n / bc) + ep)
        finite = jnp.isfinite(d)
        d = jnp.where(finite, d, 0)
        m1n = jnp.where(finite, m1n, _up(m1, a))
        m2n = jnp.where(finite, m2n, _up(m2, a))
        eta = _scalar(R).astype(a)
        wn, dn = _norm(wv), _norm(d)
        ratio = jnp.clip(wn / jnp.where(dn == 0, 1, dn), ratio_min, ratio_max)
        ratio = eta * jnp.where((wn != 0) & (dn != 0), ratio, 1)
        delta = -ratio * d
        ok = jnp.isfinite(wv + delta)
        m1n, m2n = _keep_if(signal, m1n, m1), _keep_if(signal, m2n, m2)
        # A donated input is updated in place only if every other output has read it first:
        # the moments read g, the moments and new g read w (their finite masks). Nothing in
        # the data flow orders those reads before the overwrite, so XLA copied each such
        # input (one more pass over the weights a step, seen on XLA:CPU); the barriers order
        # them. XLA still prunes the outputs a caller drops.
        m1n, m2n, g = jax.lax.optimization_barrier((m1n, m2n, g))
        new_g = _keep_if(signal, jnp.where(ok, delta, 0), g)
        new_g, m1n, m2n, w, delta = jax.lax.platform_dependent(
            new_g, m1n, m2n, w, delta, cpu=_barrier_but_last, default=_barrier_all)
        wv = _up(w)
        new_w = _keep_if(signal, jnp.where(ok, wv + delta, wv), w)
        new_mpw = None if mpw is None else _keep_if(signal, new_w.astype(mpw.dtype), mpw)
        out.append((new_w, new_g, m1n, m2n, new_mpw))
    new_step = None
    if step is not None:
        new_step = jnp.where(signal, step + 1, step).astype(step.dtype)
    return new_step, out


def inplace_clip_grad_norm(gradients, *, max_norm=1.0):
    """InplaceClipGradNorm: g * min(max_norm / (total_norm + 1e-6), 1)."""
    a = jnp.result_type(*(acc_dtype(g.dtype) for g in gradients))
    total = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(a))) for g in gradients))
    coef = jnp.minimum(max_norm / (total + 1e-6), 1)
    return [(g.astype(coef.dtype) * coef).astype(g.dtype) for g in gradients]
