"""concat and split whose derivatives run the ConcatTraining / SplitTraining kernels.

Both are the kernel-backed primitives themselves (no custom_jvp needed): they are linear, with
jvp and transpose rules, so reverse mode of concat runs the split kernel and reverse mode of
split runs the concat kernel, to any order. The forward passes run the kernels too.
"""
from jaxops.ops import concat as ops

__all__ = ["concat", "split"]


def concat(xs, axis=0):
    """The arrays `xs` (a sequence) joined along `axis`; backward pass = the split kernel."""
    out, _ = ops.concat_training(*xs, axis=axis)
    return out


def split(x, sizes, axis=0):
    """`x` cut along `axis` into pieces of extents `sizes` (static ints); a list of arrays.
    Backward pass = the concat kernel."""
    sizes = tuple(sizes)
    if not sizes:
        raise ValueError("jaxops.nn.split: sizes must not be empty")
    return list(ops.split_training(x, sizes, axis=axis))


# `sizes` is read on the host as Python ints (never narrowed): jaxops/nn/__init__.py's check of
# host int64 inputs skips it
split.static_inputs = frozenset({"sizes"})
