"""The one error class of the ONNX importer."""


class OnnxImportError(ValueError):
    """A model that cannot be imported (malformed, unsupported, unsafe), or a node that the
    importer's own checks refuse while running (a value it must know without the data, one
    over the memory budget). The message names the node (and its op) where there is one.
    Other errors of a node's handler keep their type and gain a note naming the node."""
