"""Mixed precision for imported graphs: `load(model, precision="bf16")`.

ORT's training graphs are float32 throughout. With precision="bf16" the program decides, per
node and just before its handler runs, the dtype each float operand is computed in (the rule
of torch's bf16 autocast; only float32 and bfloat16 operands are touched: integers, bools,
float64 and float16 never are, and nodes that run on the host are left exact):

  low     matmul-class ops (MatMul, Gemm, Conv, ConvTranspose, Einsum, FusedMatMul, ConvGrad,
          ConvTransposeGrad, and the fused attention that replaces MatMul -> Softmax -> MatMul
          and its gradient: handlers/fused_attention.py): every float operand cast to
          bfloat16; the product is bfloat16, accumulated in float32 by the GPU's tensor-core
          GEMMs/convolutions.
  wide    numerically sensitive ops: softmax and log-softmax and their gradients, the
          normalizations and their gradients, reductions, losses and their gradients,
          Exp/Log/Pow/Reciprocal/Softplus, CumSum, gradient accumulation (InPlaceAccumulator*)
          and the optimizers: every float operand cast to float32.
  keep    ops whose dtypes are the graph's statement (Cast, CastLike, MixedPrecisionScale) or
          that read no float values (Shape, Size): untouched.
  follow  the rest (elementwise ops, activations and their gradients, data movement):
          when some float operand is bfloat16, the op runs in bfloat16 if every float32
          operand is smaller (fewer elements) than its largest bfloat16 one (a bias, a scale,
          a mask, a constant: cast down, so the activations between two matmuls stay
          bfloat16), else in float32 (two full-size operands of mixed dtypes, e.g. the
          residual stream plus a layer's bfloat16 output: the stream stays float32, as torch's
          type promotion keeps it). Operands that are parameters of the op rather than data
          (Resize's scales, Dropout's ratio: NOT_OPERANDS) keep their dtype.

A graph's outputs that it declares float32 come back float32 (a bfloat16 logit is cast up), so
a program's interface is the same in both precisions; in-place updates keep their input's
dtype (the accumulated gradients stay float32). Parameters are never stored in bfloat16: the
casts happen where an op reads them, and XLA fuses them into their consumers.

float16 would need loss scaling (its range is too small for gradients): refused for now.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

PRECISIONS = (None, "f32", "bf16")

LOW = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul", "FusedGemm",
    "TransposeMatMul", "ConvGrad", "ConvTransposeGrad",
    # the fused attention of handlers/fused_attention.py: the MatMuls it replaces read bf16
    "FusedAttention", "FusedAttentionGrad"})

WIDE = frozenset({
    # softmax and its gradients
    "Softmax", "LogSoftmax", "SoftmaxGrad", "SoftmaxGrad_13", "LogSoftmaxGrad",
    "LogSoftmaxGrad_13", "BiasSoftmaxDropout", "SoftmaxDropoutGrad", "Hardmax",
    # normalizations and their gradients
    "LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization",
    "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalizationGrad",
    "SimplifiedLayerNormalizationGrad", "InvertibleLayerNormalizationGrad",
    "BatchNormalization", "BatchNormInternal", "BatchNormalizationGrad", "GroupNormalization",
    "InstanceNormalization", "LpNormalization", "MeanVarianceNormalization", "LRN",
    # reductions
    "ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare", "ReduceSumTraining", "ReduceAllL2", "CumSum",
    "CumProd", "GlobalAveragePool", "GlobalLpPool", "LpPool", "AveragePool",
    "AveragePoolGrad",
    # losses and their gradients
    "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropy",
    "SoftmaxCrossEntropyGrad", "SoftmaxCrossEntropyLossGrad", "SoftmaxCrossEntropyLossInternal",
    "SoftmaxCrossEntropyLossInternalGrad", "SparseSoftmaxCrossEntropy",
    "SparseSoftmaxCrossEntropyGrad",
    # functions whose range or slope bf16 resolves badly
    "Exp", "Log", "Pow", "Reciprocal", "Softplus", "Acos", "Asin", "Cosh", "Sinh", "Tan",
    # gradient accumulation and optimizers: f32 master state
    "InPlaceAccumulator", "InPlaceAccumulatorV2", "ZeroGradient", "AdamOptimizer",
    "AdamWOptimizer", "LambOptimizer", "SGDOptimizer", "SGDOptimizerV2",
    "InplaceClipGradNorm"})

KEEP = frozenset({"Cast", "CastLike", "MixedPrecisionScale", "Shape", "Size", "IsFinite",
                  "IsAllFinite", "PythonOp", "PythonOpGrad", "TritonOp", "YieldOp"})

# the inputs of a follow op that are data (cast with the activation); the others keep their
# dtype (Resize's roi and scales are read as numbers, Dropout's ratio is a probability)
NOT_OPERANDS = {"Resize": (1, 2), "Upsample": (1,), "ResizeGrad": (2, 3), "Dropout": (1,),
                "BiasDropout": (3,), "BitmaskDropout": (1,), "DropoutGrad": (2,),
                "BitmaskDropoutGrad": (2,), "Range": (0, 1, 2)}

# ops whose kernels lose to XLA's code under this policy: their inputs are cast up from
# bfloat16 and their results cast down, and XLA fuses those casts into its own softmax gradient
# while a kernel makes each a pass over memory (H100, bench/train_step.py 46M bf16: 12.8 ms a
# step with the SoftmaxGrad_13 kernel, 10.2 ms with XLA's code; docs/performance.md)
XLA = frozenset({"softmax_grad", "softmax_grad_13", "log_softmax_grad", "log_softmax_grad_13"})

_F32, _BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)


def check(precision):
    """The canonical precision (None for float32), or a ValueError naming the choices."""
    if precision in (None, "f32", "float32"):
        return None
    if precision in ("bf16", "bfloat16"):
        return "bf16"
    if precision in ("f16", "float16"):
        raise ValueError("precision='f16' needs loss scaling (float16's range loses small "
                         "gradients), which is not implemented: use precision='bf16'")
    raise ValueError(f"precision must be None, 'f32' or 'bf16', got {precision!r}")


def kind(op_type: str) -> str:
    """'low', 'wide', 'keep' or 'follow' (the module docstring)."""
    if op_type in LOW:
        return "low"
    if op_type in WIDE:
        return "wide"
    return "keep" if op_type in KEEP else "follow"


def _dtype(x):
    """x's dtype where it is float32 or bfloat16 (what the policy may cast), else None."""
    if x is None or isinstance(x, (list, tuple, str, bytes, bool, int, float)):
        return None
    d = getattr(x, "dtype", None)
    return d if d is not None and d in (_F32, _BF16) else None


def cast(x, dtype):
    """x in `dtype`: numpy stays numpy (a static value stays static), a jax value is converted."""
    if _dtype(x) is None or x.dtype == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x).astype(dtype)
    return x.astype(dtype)


class Policy:
    """The bf16 policy: `inputs(op_type, args)` gives a node's operands in the dtypes the node
    computes in."""

    def __init__(self, precision: str):
        self.precision = precision
        self.low = _BF16
        self.xla = XLA  # jaxops.ops names run as XLA's code under the policy

    def inputs(self, op_type: str, args: list) -> list:
        k = kind(op_type)
        if k == "keep":
            return args
        if k == "low":
            return [cast(a, self.low) for a in args]
        if k == "wide":
            return [[cast(v, _F32) for v in a] if isinstance(a, (list, tuple)) else cast(a, _F32)
                    for a in args]
        skip = NOT_OPERANDS.get(op_type, ())
        operands = [(i, a) for i, a in enumerate(args) if i not in skip and _dtype(a) is not None]
        low = [np.size(a) for _, a in operands if a.dtype == self.low]
        if not low or len(low) == len(operands):
            return args
        biggest = max(low)
        to = self.low if all(np.size(a) < biggest for _, a in operands
                             if a.dtype == _F32) else _F32
        out = list(args)
        for i, a in operands:
            out[i] = cast(a, to)
        return out




def like(value, ref):
    """value in ref's dtype where both are float32/bfloat16 (an in-place update keeps the
    dtype of the input it replaces); anything else unchanged."""
    return cast(value, ref.dtype) if _dtype(ref) is not None else value
