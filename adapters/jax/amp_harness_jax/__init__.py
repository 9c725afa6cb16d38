"""JAX adapter for amp-harness. Importing this package does not import jax."""
