"""Recurrent layers: RNN, GRU, LSTM (forward/reverse/bidirectional, sequence_lens, layout),
each direction a lax.scan."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..registry import handler

# activation name -> (number of alpha/beta parameters it takes, fn(x, alpha, beta))
_ACTS = {
    "relu": (0, lambda x, a, b: jnp.maximum(x, 0)),
    "tanh": (0, lambda x, a, b: jnp.tanh(x)),
    "sigmoid": (0, lambda x, a, b: jax.nn.sigmoid(x)),
    "softsign": (0, lambda x, a, b: x / (1 + jnp.abs(x))),
    "softplus": (0, lambda x, a, b: jax.nn.softplus(x)),
    "affine": (2, lambda x, a, b: a * x + b),
    "leakyrelu": (1, lambda x, a, b: jnp.where(x >= 0, x, a * x)),
    "thresholdedrelu": (1, lambda x, a, b: jnp.where(x > a, x, 0)),
    "scaledtanh": (2, lambda x, a, b: a * jnp.tanh(b * x)),
    "hardsigmoid": (2, lambda x, a, b: jnp.clip(a * x + b, 0, 1)),
    "elu": (1, lambda x, a, b: jnp.where(x >= 0, x, a * jnp.expm1(x))),
}


def _activations(names, alphas, betas, default, dirs):
    names = list(names) if names else default * dirs
    alphas, betas = list(alphas or []), list(betas or [])
    out = []
    for name in names:
        n_params, fn = _ACTS[name.lower()]
        a = alphas.pop(0) if n_params >= 1 and alphas else (0.01 if name.lower() == "leakyrelu" else 1.0)
        b = betas.pop(0) if n_params >= 2 and betas else 0.0
        out.append(lambda x, fn=fn, a=a, b=b: fn(x, a, b))
    return [out[i * len(default):(i + 1) * len(default)] for i in range(dirs)]


def _run(cell, x, h0, lens, reverse):
    """Scans cell(state, x_t) -> (state, y_t) over time; steps past a batch row's length keep
    its state and output zeros. x: [T, B, I]."""
    t_len = x.shape[0]
    steps = jnp.arange(t_len)
    if reverse:  # a reversed pass starts at each row's own last valid step
        idx = jnp.where(steps[:, None] < lens[None, :], lens[None, :] - 1 - steps[:, None], steps[:, None])
        x = jnp.take_along_axis(x, idx[:, :, None], axis=0)

    def step(state, inp):
        xt, t = inp
        new, y = cell(state, xt)
        live = (t < lens)[:, None]
        new = jax.tree_util.tree_map(lambda n, o: jnp.where(live, n, o), new, state)
        return new, jnp.where(live, y, 0)

    final, ys = lax.scan(step, h0, (x, steps))
    if reverse:
        ys = jnp.take_along_axis(ys, idx[:, :, None], axis=0)
    return final, ys


def _common(x, w, sequence_lens, initial, layout, direction, hidden, n_states):
    if layout:
        x = jnp.swapaxes(x, 0, 1)
        initial = [None if s is None else jnp.swapaxes(s, 0, 1) for s in initial]
    t_len, batch = x.shape[:2]
    dirs = 2 if direction == "bidirectional" else 1
    lens = jnp.full((batch,), t_len, jnp.int32) if sequence_lens is None else jnp.asarray(sequence_lens).astype(jnp.int32)
    init = [jnp.zeros((dirs, batch, hidden), x.dtype) if s is None else s for s in initial]
    revs = [False, True] if dirs == 2 else [direction == "reverse"]
    return x, lens, init, revs


def _finish(ys, finals, layout):
    y = jnp.stack(ys, axis=1)  # [T, dirs, B, H]
    states = [jnp.stack(s, axis=0) for s in zip(*finals)]
    if layout:
        y = jnp.transpose(y, (2, 0, 1, 3))
        states = [jnp.swapaxes(s, 0, 1) for s in states]
    return (y, *states)


@handler("RNN", since=7)
def rnn(ctx, x, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0):
    hidden = hidden_size or R.shape[-1]
    x, lens, (h0,), revs = _common(x, W, sequence_lens, [initial_h], layout, direction, hidden, 1)
    acts = _activations(activations, activation_alpha, activation_beta, ["Tanh"], len(revs))
    ys, finals = [], []
    for d, rev in enumerate(revs):
        b = jnp.zeros(2 * hidden, x.dtype) if B is None else B[d]
        bias = b[:hidden] + b[hidden:]
        f = acts[d][0]

        def cell(h, xt, d=d, bias=bias, f=f):
            pre = xt @ W[d].T + h @ R[d].T + bias
            if clip is not None:
                pre = jnp.clip(pre, -clip, clip)
            h = f(pre)
            return h, h

        hT, y = _run(cell, x, h0[d], lens, rev)
        ys.append(y)
        finals.append((hT,))
    return _finish(ys, finals, layout)[: max(ctx.num_outputs, 1)]


@handler("GRU", since=7)
def gru(ctx, x, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0, linear_before_reset=0):
    H = hidden_size or R.shape[-1]
    x, lens, (h0,), revs = _common(x, W, sequence_lens, [initial_h], layout, direction, H, 1)
    acts = _activations(activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"], len(revs))
    ys, finals = [], []
    for d, rev in enumerate(revs):
        b = jnp.zeros(6 * H, x.dtype) if B is None else B[d]
        wb, rb = b[:3 * H], b[3 * H:]
        f, g = acts[d]

        def cell(h, xt, d=d, wb=wb, rb=rb, f=f, g=g):
            xw = xt @ W[d].T + wb  # [B, 3H]: z, r, h
            hr = h @ R[d].T
            cl = (lambda v: jnp.clip(v, -clip, clip)) if clip is not None else (lambda v: v)
            z = f(cl(xw[:, :H] + hr[:, :H] + rb[:H]))
            r = f(cl(xw[:, H:2 * H] + hr[:, H:2 * H] + rb[H:2 * H]))
            if linear_before_reset:
                hh = g(cl(xw[:, 2 * H:] + r * (hr[:, 2 * H:] + rb[2 * H:])))
            else:
                hh = g(cl(xw[:, 2 * H:] + (r * h) @ R[d][2 * H:].T + rb[2 * H:]))
            h = (1 - z) * hh + z * h
            return h, h

        hT, y = _run(cell, x, h0[d], lens, rev)
        ys.append(y)
        finals.append((hT,))
    return _finish(ys, finals, layout)[: max(ctx.num_outputs, 1)]


@handler("LSTM", since=7)
def lstm(ctx, x, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None, *,
         activation_alpha=None, activation_beta=None, activations=None, clip=None,
         direction="forward", hidden_size=None, input_forget=0, layout=0):
    H = hidden_size or R.shape[-1]
    x, lens, (h0, c0), revs = _common(x, W, sequence_lens, [initial_h, initial_c], layout,
                                      direction, H, 2)
    acts = _activations(activations, activation_alpha, activation_beta,
                        ["Sigmoid", "Tanh", "Tanh"], len(revs))
    ys, finals = [], []
    for d, rev in enumerate(revs):
        b = jnp.zeros(8 * H, x.dtype) if B is None else B[d]
        bias = b[:4 * H] + b[4 * H:]
        p = jnp.zeros(3 * H, x.dtype) if P is None else P[d]
        f, g, hf = acts[d]

        def cell(state, xt, d=d, bias=bias, p=p, f=f, g=g, hf=hf):
            h, c = state
            pre = xt @ W[d].T + h @ R[d].T + bias  # i, o, f, c
            if clip is not None:
                pre = jnp.clip(pre, -clip, clip)
            i = f(pre[:, :H] + p[:H] * c)
            fg = f(pre[:, 2 * H:3 * H] + p[2 * H:] * c)
            if input_forget:
                fg = 1 - i
            c = fg * c + i * g(pre[:, 3 * H:])
            o = f(pre[:, H:2 * H] + p[H:2 * H] * c)
            h = o * hf(c)
            return (h, c), h

        (hT, cT), y = _run(cell, x, (h0[d], c0[d]), lens, rev)
        ys.append(y)
        finals.append((hT, cT))
    return _finish(ys, finals, layout)[: max(ctx.num_outputs, 1)]
