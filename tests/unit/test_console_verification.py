"""The Verify page's run of ``ztate verify --json``: its output is read as it comes, so
a verifier that prints without end (a ledger tampered at every record prints a finding
each) costs the console a line at a time, and the count and the summary stay right.
The child here is a real process standing in for the verifier."""

from __future__ import annotations

import asyncio
import sys
import tracemalloc
from typing import Any

import pytest

from ztate.services.console import verification

FINDINGS = 100_000  # about 12 MB of output
CHILD = f"""
import json, sys
finding = json.dumps({{"type": "finding", "check": "record.digest", "found": "x" * 60}})
out = sys.stdout
for _ in range({FINDINGS}):
    out.write(finding + "\\n")
out.write(json.dumps({{"type": "summary", "threads": 1, "records": {FINDINGS}}}) + "\\n")
sys.stderr.write("e" * 100_000)
sys.exit(1)
"""


async def test_a_verifier_that_prints_without_end_is_read_a_line_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, the whole output was read first (``communicate``) and cut afterwards: 12 MB
    held twice, a finding count of what fitted 4 MiB, and the summary, which comes
    last, lost."""
    spawn = asyncio.create_subprocess_exec

    async def stand_in(*argv: Any, **kwargs: Any) -> Any:
        return await spawn(sys.executable, "-c", CHILD, **kwargs)

    monkeypatch.setattr(verification.asyncio, "create_subprocess_exec", stand_in)
    tracemalloc.start()
    try:
        result = await verification.run_verify(None, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert result.exit_code == 1
    assert result.findings_total == FINDINGS
    assert len(result.findings) == verification.MAX_FINDINGS_SHOWN
    assert result.summary == {"type": "summary", "threads": 1, "records": FINDINGS}
    assert peak < 8 * 1024 * 1024, peak
