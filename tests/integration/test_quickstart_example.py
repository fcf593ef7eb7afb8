"""The README's worked example runs, as a separate worker process, and says what the
README says it says."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.harness import Pki

REPO = Path(__file__).resolve().parents[2]


async def test_quickstart_example_runs_against_the_service(target: str, pki: Pki) -> None:
    for node in ("input-parser", "planner"):
        pki.node(node)
    pki.operator("admin")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "examples" / "quickstart.py"),
        "--target",
        target,
        "--certs",
        str(pki.certs),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    lines = stdout.decode().splitlines()
    assert lines[1] == (
        "parser sees version 0: {'raw_text': 'please refund order A-42, it arrived broken'}"
    )
    assert lines[2].startswith("committed version 1, signed with key ")
    assert lines[3] == "refused: KEY_NOT_WRITABLE ['execution_permissions', 'is_admin']"
    assert lines[4] == "refused: STALE_VERSION, head is at 1"
    assert lines[5] == (
        "planner sees: {'authority': {'acting_for': 'support desk', 'tenant': 'acme'}, "
        "'requested_action': {'action': 'refund', 'amount_cents': 1299, 'order_id': 'A-42'}, "
        "'target_user_id': '123e4567-e89b-42d3-a456-426614174000'}"
    )
