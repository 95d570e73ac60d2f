"""Benchmarks: `python -m bench [--quick] [--out results.json] [--only NAME]`.

One module per op family, `bench/<family>.py`, exposing `cases(quick) -> list[Case]` (see
`bench.harness.Case`); `bench/__main__.py` lists the families in FAMILIES. `bench.harness`
holds the shared machinery: copy bandwidth, timing, correctness checks, the table, the JSON.

This module must not import jax: `python -m bench` sets allocator defaults before it does.
"""
