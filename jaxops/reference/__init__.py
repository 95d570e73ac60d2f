"""Pure-JAX references of every op: the test oracle and the JAXOPS_DISABLE fallback."""
