"""Which ops run their pure-JAX references instead of their kernels.

JAXOPS_DISABLE: 'all', or a comma list of op names. Also `routed_to_xla(names)`: while it is
active (an importer policy that measured XLA faster for some ops in its context), those ops
run their references too. Both are read at trace time, so a jitted function keeps what it
was traced with."""
import contextlib
import contextvars
import os

_ROUTED: contextvars.ContextVar[frozenset] = contextvars.ContextVar("jaxops_routed",
                                                                   default=frozenset())


@contextlib.contextmanager
def routed_to_xla(names):
    token = _ROUTED.set(_ROUTED.get() | frozenset(names))
    try:
        yield
    finally:
        _ROUTED.reset(token)


def disabled(name: str) -> bool:
    if name in _ROUTED.get():
        return True
    value = os.environ.get("JAXOPS_DISABLE", "")
    if not value:
        return False
    names = {n.strip() for n in value.split(",")}
    return "all" in names or name in names
