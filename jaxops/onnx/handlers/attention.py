"""Attention (opset 23/24) and RotaryEmbedding (opset 23)."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from ..registry import handler
from ._util import np_dtype


def _heads(x, n):
    """[B, S, n*H] -> [B, n, S, H]."""
    b, s, _ = x.shape
    return x.reshape(b, s, n, -1).transpose(0, 2, 1, 3)


def _window_bias(q_len, kv_len, offset, left, right, causal, dtype):
    """0 where query i may see key j, -inf elsewhere. offset: scalar or per-batch [B]."""
    i = jnp.arange(q_len)[:, None]
    j = jnp.arange(kv_len)[None, :]
    off = jnp.asarray(offset)
    per_batch = off.ndim > 0
    p = i + (off.reshape(-1, 1, 1) if per_batch else off)  # absolute query position
    allowed = jnp.ones(p.shape[:-1] + (kv_len,), bool) if per_batch else jnp.ones((q_len, kv_len), bool)
    if causal:
        allowed = allowed & (j <= p)
    if left >= 0:
        allowed = allowed & (p - j <= left)
    if right >= 0:
        allowed = allowed & (j - p <= right)
    bias = jnp.where(allowed, jnp.zeros((), dtype), jnp.asarray(-jnp.inf, dtype))
    return bias[:, None] if per_batch else bias


def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *,
              is_causal=0, kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0,
              scale=None, softcap=0.0, softmax_precision=None, left_window_size=-1,
              right_window_size=-1):
    three_d = Q.ndim == 3
    if three_d:
        Q, K, V = _heads(Q, q_num_heads), _heads(K, kv_num_heads), _heads(V, kv_num_heads)
    dt = Q.dtype
    if scale is None:
        scale = 1.0 / np.sqrt(Q.shape[-1])
    if past_key is not None:
        K = jnp.concatenate([past_key, K], axis=2)
        V = jnp.concatenate([past_value, V], axis=2)
    present_k, present_v = K, V
    q_len, kv_len = Q.shape[2], K.shape[2]

    bias = jnp.zeros((q_len, kv_len), dt)
    if attn_mask is not None:
        m = attn_mask
        if m.shape[-1] < kv_len:  # a short mask leaves the trailing keys masked
            fill = False if m.dtype == jnp.bool_ else -jnp.inf
            m = jnp.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, kv_len - m.shape[-1])], constant_values=fill)
        if m.dtype == jnp.bool_:
            m = jnp.where(m, jnp.zeros((), dt), jnp.asarray(-jnp.inf, dt))
        bias = bias + m.astype(dt)
    if nonpad_kv_seqlen is not None and past_key is None:
        offset = nonpad_kv_seqlen.reshape(-1) - q_len
    else:
        offset = 0 if past_key is None else past_key.shape[2]
    lw = -1 if left_window_size is None else left_window_size
    rw = -1 if right_window_size is None else right_window_size
    if is_causal or lw >= 0 or rw >= 0:
        bias = bias + _window_bias(q_len, kv_len, offset, lw, rw, bool(is_causal), dt)
    if nonpad_kv_seqlen is not None:
        pad = jnp.arange(kv_len)[None, :] < nonpad_kv_seqlen.reshape(-1, 1)
        bias = bias + jnp.where(pad, 0.0, -jnp.inf).astype(dt)[:, None, None, :]

    hq, hk = Q.shape[1], K.shape[1]
    if hq != hk:  # grouped-query attention: each kv head serves hq // hk query heads
        K = jnp.repeat(K, hq // hk, axis=1)
        V = jnp.repeat(V, hq // hk, axis=1)
    s = jnp.asarray(np.sqrt(scale), dt)
    scores = jnp.matmul(Q * s, jnp.swapaxes(K * s, -1, -2))
    if softcap:
        c = jnp.asarray(softcap, dt)
        scores = jnp.tanh(scores / c) * c
    biased = scores + bias
    qk_out = biased if qk_matmul_output_mode == 2 else scores
    logits = biased.astype(np_dtype(softmax_precision)) if softmax_precision else biased
    mx = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isneginf(mx), 0, mx))
    total = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(total == 0, 1, total)
    dead = jnp.isneginf(jnp.max(jnp.broadcast_to(bias, biased.shape), axis=-1, keepdims=True))
    probs = jnp.where(dead, jnp.zeros((), probs.dtype), probs)
    if qk_matmul_output_mode == 3:
        qk_out = probs
    probs = probs.astype(dt)
    y = jnp.matmul(probs, V)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)
    return y, present_k, present_v, qk_out.astype(dt)


@handler("Attention", since=23)
def attention_23(ctx, *inputs, **attrs):
    outs = attention(*inputs, **attrs)
    return outs[0] if ctx.num_outputs == 1 else outs[: ctx.num_outputs]


@handler("RotaryEmbedding", since=23)
def rotary_embedding(ctx, x, cos_cache, sin_cache, position_ids=None, *, interleaved=0,
                     num_heads=0, rotary_embedding_dim=0):
    """x: [B, S, hidden] (num_heads given) or [B, heads, S, head]."""
    three_d = x.ndim == 3
    if three_d:
        b, s, _ = x.shape
        x4 = x.reshape(b, s, num_heads, -1)
    else:
        x4 = x.transpose(0, 2, 1, 3)  # [B, S, heads, head]
    head = x4.shape[-1]
    rot = rotary_embedding_dim or head
    if position_ids is not None:
        cos = cos_cache[position_ids]  # [B, S, rot/2]
        sin = sin_cache[position_ids]
    else:
        cos, sin = cos_cache, sin_cache
    cos = cos[..., : rot // 2][..., None, :]
    sin = sin[..., : rot // 2][..., None, :]
    xr, rest = x4[..., :rot], x4[..., rot:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    if interleaved:
        xr = jnp.stack([r1, r2], axis=-1).reshape(xr.shape)
    else:
        xr = jnp.concatenate([r1, r2], axis=-1)
    y = jnp.concatenate([xr, rest], axis=-1).astype(x.dtype)
    return y.reshape(x.shape) if three_d else y.transpose(0, 2, 1, 3)


def _split_heads(x, n):
    b, t, _ = x.shape
    return x.reshape(b, t, n, -1).transpose(0, 2, 1, 3)  # [B, n, T, d]


@handler("LinearAttention", since=27)
def linear_attention(ctx, query, key, value, past_state=None, decay=None, beta=None, *,
                     chunk_size=None, kv_num_heads, q_num_heads, scale=None,
                     update_rule="gated_delta"):
    """Recurrent linear attention: a [d_k, d_v] state per kv head, optionally decayed
    (gated) and delta-corrected, read by every query head of its group. f32 inside."""
    gated = update_rule in ("gated", "gated_delta")
    delta = update_rule in ("delta", "gated_delta")
    f32 = jnp.float32
    # jnp throughout: the scan below indexes these with a traced step
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    decay = None if decay is None else jnp.asarray(decay)
    beta = None if beta is None else jnp.asarray(beta)
    b, t, _ = query.shape
    q = _split_heads(query, q_num_heads).astype(f32)
    k = _split_heads(key, kv_num_heads).astype(f32)
    v = _split_heads(value, kv_num_heads).astype(f32)
    d_k, d_v = q.shape[-1], v.shape[-1]
    group = q_num_heads // kv_num_heads
    g = None
    if gated:
        g = (decay.reshape(b, t, kv_num_heads, 1).transpose(0, 2, 1, 3)
             if decay.shape[-1] == kv_num_heads else _split_heads(decay, kv_num_heads)).astype(f32)
    bt = None
    if delta:
        bt = beta.reshape(b, t, beta.shape[-1], 1).transpose(0, 2, 1, 3).astype(f32)
    state0 = (jnp.zeros((b, kv_num_heads, d_k, d_v), f32) if past_state is None
              else jnp.asarray(past_state).astype(f32))
    s = 1.0 / np.sqrt(d_k) if not scale else float(scale)

    def step(state, i):
        kt, vt = k[:, :, i], v[:, :, i]
        if gated:
            state = state * jnp.exp(g[:, :, i])[..., None]
        if delta:
            vt = bt[:, :, i] * (vt - jnp.einsum("bhdm,bhd->bhm", state, kt))
        state = state + kt[..., :, None] * vt[..., None, :]
        read = jnp.repeat(state, group, axis=1) if group > 1 else state
        return state, s * jnp.einsum("bhd,bhdm->bhm", q[:, :, i], read)

    state, ys = jax.lax.scan(step, state0, jnp.arange(t))  # ys: [T, B, Hq, d_v]
    y = ys.transpose(1, 0, 2, 3).reshape(b, t, q_num_heads * d_v).astype(query.dtype)
    present = state.astype(query.dtype if past_state is None else past_state.dtype)
    return y, present


_SOFTMAX_TYPES = {1: jnp.float32, 10: jnp.float16, 16: jnp.bfloat16, 11: jnp.float64}


@handler("FlexAttention", since=1, domain="ai.onnx.preview")
def flex_attention(ctx, Q, K, V, *, scale=None, score_mod=None, prob_mod=None,
                   softmax_precision=None):
    """Attention whose scores and probabilities pass through optional subgraphs
    (score_mod, prob_mod: one input, one output). Half precision computes in f32."""
    Q, K, V = jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V)
    if scale is None:
        scale = 1.0 / np.sqrt(Q.shape[-1])
    hq, hk = Q.shape[1], K.shape[1]
    if hq != hk:
        K, V = jnp.repeat(K, hq // hk, axis=1), jnp.repeat(V, hq // hk, axis=1)
    s = jnp.asarray(np.sqrt(np.float32(scale)), Q.dtype)
    scores = jnp.matmul(Q * s, jnp.swapaxes(K * s, -1, -2))
    if softmax_precision is not None:
        ct = _SOFTMAX_TYPES[softmax_precision]
    else:
        ct = jnp.float32 if Q.dtype.itemsize < 4 else Q.dtype
    scores = scores.astype(ct)
    if score_mod is not None:
        scores = jnp.asarray(ctx.run_graph(score_mod, scores)[0]).astype(ct)
    probs = jax.nn.softmax(scores, axis=-1)
    if prob_mod is not None:
        probs = jnp.asarray(ctx.run_graph(prob_mod, probs)[0]).astype(ct)
    return jnp.matmul(probs, V.astype(ct)).astype(V.dtype)
