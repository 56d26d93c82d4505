"""`dfca submit|status|stop|logs|results`: drive the distributed runtime's REST API from the command line."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the runtime commands to the `dfca` app."""
