"""`python -m dspine_jax ...` is the `dspine` command (for environments without the script)."""

from dspine_jax.cli import main

main()
