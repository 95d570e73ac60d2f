"""JAXOPS_DISABLE: 'all', or a comma list of op names, routes those ops to their pure-JAX
references. Read at trace time, so a jitted function keeps what it was traced with."""
import os


def disabled(name: str) -> bool:
    value = os.environ.get("JAXOPS_DISABLE", "")
    if not value:
        return False
    names = {n.strip() for n in value.split(",")}
    return "all" in names or name in names
