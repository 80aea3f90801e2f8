"""Drafter training front end (Optax + Orbax over a jax.sharding.Mesh); see issue 5."""
