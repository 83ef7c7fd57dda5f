"""moekit: Mixture-of-Experts kernels for C++ and JAX.

`moekit.jax` holds the JAX functions (XLA FFI calls into the C++ kernels, differentiable through
`jax.custom_vjp`). Importing `moekit` alone does not import JAX.
"""

__version__ = "0.1.0"
