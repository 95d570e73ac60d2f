"""TfIdfVectorizer over integer tokens (string tokens are not representable in JAX)."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from ..registry import handler


@handler("TfIdfVectorizer", since=9)
def tfidf_vectorizer(ctx, x, *, max_gram_length, max_skip_count, min_gram_length, mode,
                     ngram_counts, ngram_indexes, pool_int64s=None, pool_strings=None,
                     weights=None):
    if pool_int64s is None:
        raise ValueError("TfIdfVectorizer: string pools are not supported (JAX has no strings)")
    pool = np.asarray(pool_int64s, np.int64)
    starts = list(ngram_counts) + [len(pool)]
    columns = np.asarray(ngram_indexes, np.int64)
    size = int(columns.max()) + 1 if columns.size else 0
    tokens = jnp.asarray(x)
    batched = tokens.ndim == 2
    tokens = tokens if batched else tokens[None]
    length = tokens.shape[1]
    counts = jnp.zeros((tokens.shape[0], len(columns)), jnp.float32)
    gram_id = 0
    for n in range(1, len(ngram_counts) + 1):
        grams = pool[starts[n - 1]:starts[n]].reshape(-1, n)  # pool grams of length n
        ids = np.arange(gram_id, gram_id + len(grams))
        gram_id += len(grams)
        if not (min_gram_length <= n <= max_gram_length) or not len(grams):
            continue
        for skip in range(max_skip_count + 1 if n > 1 else 1):
            step = skip + 1
            first = np.arange(length - (n - 1) * step)
            if first.size == 0:
                continue
            windows = tokens[:, first[:, None] + np.arange(n)[None, :] * step]  # [B, P, n]
            hits = jnp.all(windows[:, :, None, :] == grams[None, None], axis=-1)  # [B, P, G]
            counts = counts.at[:, ids].add(hits.sum(axis=1).astype(jnp.float32))
    w = jnp.ones(len(columns), jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
    if mode == "IDF":
        counts = jnp.minimum(counts, 1) * w
    elif mode == "TFIDF":
        counts = counts * w
    out = jnp.zeros((tokens.shape[0], size), jnp.float32).at[:, columns].add(counts)
    return out if batched else out[0]
