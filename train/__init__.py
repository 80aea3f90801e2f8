"""Drafter training (installed as `dspine_train`): config, data, the step, the loop,
checkpoints and metrics, over a jax.sharding.Mesh (Optax + Orbax)."""
