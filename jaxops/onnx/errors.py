"""The one error class of the ONNX importer."""


class OnnxImportError(ValueError):
    """A model that cannot be imported or run: malformed, unsupported, unsafe, or a node whose
    inputs do not fit it. The message names the node (and its op) where there is one."""
