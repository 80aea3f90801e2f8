"""The `dspine` command (a front end over dspine_jax, dspine_train and dspine_serve)."""
