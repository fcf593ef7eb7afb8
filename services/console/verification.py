"""The console's verification page runs ``ztate verify --json`` (services/cli/verify.py,
the verifier's one implementation) as a child process and shows what it printed.

What it verifies (the database the console's environment names, or ``--verify-bundle``)
is fixed when the console starts: the browser never names a file.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

VERIFY_TIMEOUT_SECONDS = 300.0
MAX_FINDINGS_SHOWN = 200
MAX_LINE_BYTES = 1024 * 1024  # a finding line is at most a few KB
MAX_ERROR_BYTES = 2000  # of the verifier's stderr, when it could not run


@dataclass
class VerifyResult:
    ran_at: str
    exit_code: int | None
    summary: dict[str, Any] | None
    findings: list[dict[str, Any]] = field(default_factory=list)
    findings_total: int = 0
    error: str | None = None

    @property
    def verdict(self) -> str:
        if self.exit_code == 0:
            return "verified"
        if self.exit_code == 1:
            return "failures found"
        return "could not run"


async def run_verify(bundle: Path | None, thread_id: str | None) -> VerifyResult:
    """``ztate verify --json`` over the database (or the bundle), one thread or all."""
    argv = [sys.executable, "-m", "ztate.services.cli.main", "verify", "--json"]
    if bundle is not None:
        argv.append(f"--bundle={bundle}")
    if thread_id:
        argv.append(f"--thread={thread_id}")
    ran_at = datetime.now(UTC).isoformat(timespec="seconds")
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        limit=MAX_LINE_BYTES,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    result = VerifyResult(ran_at, None, None)
    try:
        # read as it comes, never all of it: a verifier's output grows with the ledger
        # (a tampered one prints a finding a record), and only so much is shown
        async with asyncio.timeout(VERIFY_TIMEOUT_SECONDS):
            _, err = await asyncio.gather(
                _read_findings(process.stdout, result), _tail(process.stderr)
            )
            await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()
        return VerifyResult(ran_at, None, None, error="verification took too long; stopped")
    result.exit_code = process.returncode
    if process.returncode not in (0, 1):
        text = err.decode("utf-8", "replace").strip()
        result.error = text or f"ztate verify exited {process.returncode}"
    return result


async def _read_findings(stream: asyncio.StreamReader, result: VerifyResult) -> None:
    """Every line of ``ztate verify --json``: the summary kept, every finding counted,
    the first ``MAX_FINDINGS_SHOWN`` kept; at most one line in memory at a time."""
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # longer than any line the verifier writes: dropped unread
            continue
        if not line:
            return
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        if doc.get("type") == "summary":
            result.summary = doc
        elif doc.get("type") == "finding":
            result.findings_total += 1
            if len(result.findings) < MAX_FINDINGS_SHOWN:
                result.findings.append(doc)


async def _tail(stream: asyncio.StreamReader) -> bytes:
    """The last ``MAX_ERROR_BYTES`` of ``stream`` (what the page shows of a failure)."""
    tail = b""
    while chunk := await stream.read(64 * 1024):
        tail = (tail + chunk)[-MAX_ERROR_BYTES:]
    return tail
