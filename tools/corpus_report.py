"""Prints how jaxops' training of the real-model corpus (tests/data/corpus) compares with ORT's
recorded run, as a markdown table: per export, the largest relative loss difference over the
recorded steps and the largest step-1 gradient difference relative to the model's largest
|gradient|. The same training as tests/test_corpus.py (float64 enabled, as in the tests, for
the comparison arithmetic; the training itself is float32).

    python tools/corpus_report.py
"""
import sys
from pathlib import Path

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_corpus as corpus  # noqa: E402  (tests/ on the path)


def main():
    print("| export | losses vs ORT | gradients vs ORT |\n|---|---|---|")
    for name in corpus.EXPORTS:
        ref, data = corpus._reference(name)
        losses, grads = corpus._train(name, ref, data)
        loss_err = np.max(np.abs(losses - data["losses"]) / np.abs(data["losses"]))
        err, scale = corpus._max_error(grads, {n: data[f"grad_{n}"] for n in ref["trainable"]})
        print(f"| {name} | {loss_err:.1e} | {err / scale:.1e} |", flush=True)


if __name__ == "__main__":
    main()
