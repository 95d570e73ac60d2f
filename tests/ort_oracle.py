"""Runs one com.microsoft (or ONNX) node in onnxruntime-training on CPU: the oracle."""
import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402

NP_TO_ONNX = {np.dtype(np.float32): onnx.TensorProto.FLOAT,
              np.dtype(np.float64): onnx.TensorProto.DOUBLE,
              np.dtype(np.float16): onnx.TensorProto.FLOAT16,
              np.dtype(np.int32): onnx.TensorProto.INT32,
              np.dtype(np.int64): onnx.TensorProto.INT64,
              np.dtype(np.int8): onnx.TensorProto.INT8,
              np.dtype(np.int16): onnx.TensorProto.INT16,
              np.dtype(np.uint8): onnx.TensorProto.UINT8,
              np.dtype(np.uint16): onnx.TensorProto.UINT16,
              np.dtype(np.uint32): onnx.TensorProto.UINT32,
              np.dtype(np.uint64): onnx.TensorProto.UINT64,
              np.dtype(np.bool_): onnx.TensorProto.BOOL}


def run_node(op_type, inputs, out_dtypes=None, domain="com.microsoft", opset=17,
             out_shapes=None, **attrs):
    """Builds a one-node model over numpy `inputs` (None: an absent optional input) and runs
    it with the CPU provider.
    Outputs are typed `out_dtypes` (default: one output of the first input's dtype) and
    declared with `out_shapes` where given (kernels such as MaxPoolGrad read them)."""
    out_dtypes = out_dtypes or [inputs[0].dtype]
    out_shapes = out_shapes or [None] * len(out_dtypes)
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]  # None: absent
    outs = [f"out{i}" for i in range(len(out_dtypes))]
    node = helper.make_node(op_type, names, outs, domain=domain, **attrs)
    graph = helper.make_graph(
        [node], "oracle",
        [helper.make_tensor_value_info(n, NP_TO_ONNX[x.dtype], x.shape)
         for n, x in zip(names, inputs) if x is not None],
        [helper.make_tensor_value_info(o, NP_TO_ONNX[np.dtype(d)], s)
         for o, d, s in zip(outs, out_dtypes, out_shapes)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # onnxruntime 1.19 refuses newer IR versions
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # ORT may write into its inputs (in-place ops): hand it copies
    return session.run(None, {n: np.array(x, copy=True) for n, x in zip(names, inputs)
                              if x is not None})


# Plain onnxruntime lacks the com.microsoft training kernels: only onnxruntime-training has them.
try:
    run_node("SoftmaxGrad", [np.ones((1, 2), np.float32)] * 2)
except Exception as e:  # noqa: BLE001 - any failure here means no training kernels
    pytest.skip(f"onnxruntime {ort.__version__} without training ops ({e}); install "
                "onnxruntime-training-cpu==1.19.2", allow_module_level=True)
