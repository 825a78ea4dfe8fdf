"""sowtel: observability for JAX."""
