"""A worker process holds no database driver and no server code."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("asyncpg", "psycopg", "services", "transition_service", "approval_service")


def test_worker_sdk_imports_no_server_or_database_module() -> None:
    probe = (
        "import sys, worker_sdk\n"
        "from worker_sdk import ZtateClient\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == ""
