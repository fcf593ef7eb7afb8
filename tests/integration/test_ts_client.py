"""The TypeScript client package (worker_sdk/typescript) against the real service over
mTLS: its node:test suite, run here so that `make test` runs it. The same run checks
the package's receipt, checkpoint and transition-digest code against the files of
tests/vectors/ that ztate.contract's tests run. Then examples/ts-worker, a worker
that uses nothing but the package. Both are installed from their own
package-lock.json (`npm ci`)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import INITIAL, TRUST_DOMAIN, Pki, client, new_thread_id
from ztate.services.cli import ca
from ztate.services.cli.main import main as ztate
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Identity, Role

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "worker_sdk" / "typescript"
EXAMPLE = ROOT / "examples" / "ts-worker"
NODE, NPM = shutil.which("node"), shutil.which("npm")


def npm(folder: Path, *args: str) -> None:
    assert NPM is not None
    subprocess.run(
        [NPM, *args, "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=folder,
        check=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def installed() -> Path:
    if NODE is None or NPM is None:
        pytest.fail("Node.js and npm are required by the test suite (every CI machine has them)")
    if not (PACKAGE / "node_modules" / "@connectrpc" / "connect-node").exists():
        npm(PACKAGE, "ci")
    npm(PACKAGE, "run", "build")
    return PACKAGE


@pytest.fixture(scope="module")
def example(installed: Path) -> Path:
    if not (EXAMPLE / "node_modules" / "@ztate" / "worker").exists():
        npm(EXAMPLE, "ci")
    npm(EXAMPLE, "run", "build")
    return EXAMPLE


async def test_the_typescript_client_passes_its_suite_against_the_service(
    installed: Path, target: str, pki: Pki, settings: Settings, tmp_path: Path
) -> None:
    thread_id, runner_thread = new_thread_id(), new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        await operator.create_thread(runner_thread, INITIAL, policy="pipeline")
    creds, stranger = pki.node("input-parser"), pki.foreign("input-parser")
    expired, planner = pki.expired("input-parser"), pki.node("planner")
    # a certificate of its own, revoked by serial in the service's revocation list
    revoked = ca.issue(pki.ca_dir, Identity(TRUST_DOMAIN, Role.NODE, "input-parser"), tmp_path)
    assert settings.revocation_list_file is not None
    listed = str(settings.revocation_list_file)
    assert ztate(["ca", "revoke", "--cert", str(revoked.cert), "--list", listed]) == 0
    with socket.socket() as probe:  # a loopback port that was just free: nothing listens
        probe.bind(("127.0.0.1", 0))
        down = f"localhost:{probe.getsockname()[1]}"
    assert NPM is not None
    process = await asyncio.create_subprocess_exec(
        NPM,
        "test",
        "--silent",
        cwd=installed,
        env={
            **os.environ,
            "ZTATE_TARGET": target,
            "ZTATE_CERT": str(creds.cert),
            "ZTATE_KEY": str(creds.key),
            "ZTATE_CA": str(creds.ca),
            "ZTATE_FOREIGN_CERT": str(stranger.cert),
            "ZTATE_FOREIGN_KEY": str(stranger.key),
            "ZTATE_FOREIGN_CA": str(pki.foreign_ca_dir / ca.CA_CERT),
            "ZTATE_EXPIRED_CERT": str(expired.cert),
            "ZTATE_EXPIRED_KEY": str(expired.key),
            "ZTATE_REVOKED_CERT": str(revoked.cert),
            "ZTATE_REVOKED_KEY": str(revoked.key),
            "ZTATE_DOWN_TARGET": down,
            "ZTATE_PLANNER_CERT": str(planner.cert),
            "ZTATE_PLANNER_KEY": str(planner.key),
            "ZTATE_THREAD": thread_id,
            "ZTATE_RUNNER_THREAD": runner_thread,
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 180)
    report = stdout.decode()
    assert process.returncode == 0, report + stderr.decode()
    counts = {m[0]: int(m[1]) for m in re.findall(r"^# (pass|fail|skipped) (\d+)$", report, re.M)}
    assert counts["fail"] == 0, report
    assert counts["skipped"] == 0, report
    assert counts["pass"] >= 53, report


async def test_the_typescript_example_worker_uses_only_the_package(
    example: Path, target: str, pki: Pki
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    creds = pki.node("input-parser")
    assert NODE is not None
    process = await asyncio.create_subprocess_exec(
        NODE,
        str(example / "dist" / "worker.js"),
        "--target",
        target,
        "--cert",
        str(creds.cert),
        "--key",
        str(creds.key),
        "--ca",
        str(creds.ca),
        "--thread",
        thread_id,
        "--patch",
        '{"requested_action": {"action": "lookup", "order_id": "A-42"}}',
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    view, committed, refused = [json.loads(line) for line in stdout.decode().splitlines()]
    assert view == {"step": "view", "version": 0, "state": {"raw_text": INITIAL["raw_text"]}}
    assert committed["version"] == 1
    assert committed["node_id"] == "spiffe://ztate.test/node/input-parser"
    assert committed["digest"] == ""  # not marked read_records (docs/api.md)
    assert refused["reason"] == "KEY_NOT_WRITABLE"
    assert refused["keys"] == ["is_admin"]


def test_the_generated_typescript_is_what_the_protos_make(installed: Path, tmp_path: Path) -> None:
    """As `make proto-check` does for Python: src/gen/ is never edited by hand or stale."""
    buf = Path(sys.executable).with_name("buf")
    subprocess.run(
        [str(buf), "generate", "--template", "buf.gen.yaml", "-o", str(tmp_path)],
        cwd=installed,
        check=True,
        timeout=120,
    )
    made = {p.relative_to(tmp_path / "src" / "gen"): p.read_bytes() for p in tmp_path.rglob("*.ts")}
    kept = {
        p.relative_to(installed / "src" / "gen"): p.read_bytes()
        for p in (installed / "src" / "gen").rglob("*.ts")
    }
    assert made == kept, "run `npm run generate` in worker_sdk/typescript and commit"
