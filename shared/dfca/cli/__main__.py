"""`python -m dfca.cli`: the `dfca` command (dfca.cli.main)."""

from dfca.cli.main import main

main()
