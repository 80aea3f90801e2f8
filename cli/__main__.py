"""`python -m dspine_cli ...` is the `dspine` command (for environments without the script)."""

from dspine_cli.main import main

main()
