"""Kernels that take their derivatives from a reference of the same math."""
import jax


def with_derivatives_of(reference, kernel):
    """kernel's values with reference's derivatives (both f(*args) of the same math)."""
    f = jax.custom_jvp(kernel)
    f.defjvp(lambda primals, tangents: (kernel(*primals),
                                        jax.jvp(reference, primals, tangents)[1]))
    return f
