"""The TypeScript client package (worker_sdk/typescript) against the real service over
mTLS: its node:test suite, run here so that `make test` runs it. The same run checks
the package's receipt, checkpoint and transition-digest code against the files of
tests/vectors/ that ztate.contract's tests run. Then examples/ts-worker, a worker
that uses nothing but the package. Both are installed from their own
package-lock.json (`npm ci`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.harness import INITIAL, TRUST_DOMAIN, Pki, client, new_thread_id, run_example_worker
from ztate.approval_service.app import start as start_approval
from ztate.contract.keyring import generate_signing_key
from ztate.services.cli import ca
from ztate.services.cli.main import main as ztate
from ztate.services.runtime.config import ApprovalSettings, Settings
from ztate.services.runtime.identity import Identity, Role
from ztate.transition_service import decisions
from ztate.transition_service.app import start

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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.asynccontextmanager
async def approval_pair(
    settings: Settings, dsn: str, pki: Pki, root: Path
) -> AsyncIterator[dict[str, str]]:
    """A transition service and an approval service that know each other (receipts
    delivered, heads checkpointed), and what a TypeScript test needs to use them."""
    transition_port, approval_port = free_port(), free_port()
    receipts = (root / "approval-signing.pem", root / "approval-public.json")
    checkpoints = (root / "checkpoint-signing.pem", root / "checkpoint-public.json")
    generate_signing_key(*receipts, "approval-k1")
    generate_signing_key(*checkpoints, "checkpoint-k1")
    issued = ca.issue(
        pki.ca_dir,
        Identity(TRUST_DOMAIN, Role.SERVICE, "approval"),
        root / "approval-certs",
        dns_names=("localhost",),
        ip_addresses=("127.0.0.1",),
    )
    approval = await start_approval(
        ApprovalSettings(
            ZTATE_HOME=root / "approval-home",
            ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
            listen=f"127.0.0.1:{approval_port}",
            tls_cert=issued.cert,
            tls_key=issued.key,
            tls_ca=issued.ca_cert,
            signing_key_file=receipts[0],
            key_id="approval-k1",
            transition_target=f"localhost:{transition_port}",
            transition_server_name="localhost",
            outbox_interval_seconds=0.2,
            db_pool_size=2,
        ),
        dsn=dsn,
    )
    try:
        transition = await start(
            settings.model_copy(
                update={
                    "listen": f"127.0.0.1:{transition_port}",
                    "approval_target": f"localhost:{approval_port}",
                    "approval_public_keys_file": receipts[1],
                    "outbox_interval_seconds": 0.2,
                    "checkpoint_key_file": checkpoints[0],
                    "checkpoint_public_keys_file": checkpoints[1],
                    "checkpoint_journal_file": root / "journal.jsonl",
                    "checkpoint_interval_seconds": 0.2,
                }
            ),
            dsn=dsn,
        )
        try:
            planner, writer = pki.node("planner"), pki.node("db-writer")
            reviewer = pki.identity(Role.REVIEWER, "alice")
            yield {
                "ZTATE_PAIR_TARGET": f"localhost:{transition_port}",
                "ZTATE_APPROVAL_SERVICE": f"localhost:{approval_port}",
                "ZTATE_WRITER_CERT": str(writer.cert),
                "ZTATE_WRITER_KEY": str(writer.key),
                "ZTATE_REVIEWER_CERT": str(reviewer.cert),
                "ZTATE_REVIEWER_KEY": str(reviewer.key),
                "ZTATE_RECEIPT_KEYS": str(receipts[1]),
                "ZTATE_CHECKPOINT_KEYS": str(checkpoints[1]),
                "ZTATE_PLANNER_CERT": str(planner.cert),
                "ZTATE_PLANNER_KEY": str(planner.key),
            }
        finally:
            await transition.stop(grace=1.0)
    finally:
        await approval.stop(grace=1.0)


@contextlib.asynccontextmanager
async def short_lived_streams(
    settings: Settings, dsn: str, pki: Pki
) -> AsyncIterator[dict[str, str]]:
    """A transition service whose watch streams end (OK) after 1.5 s, and a thread on it."""
    running = await start(
        settings.model_copy(
            update={"listen": f"127.0.0.1:{free_port()}", "watch_max_stream_seconds": 1.5}
        ),
        dsn=dsn,
    )
    try:
        target = f"localhost:{running.port}"
        thread_id = new_thread_id()
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        yield {"ZTATE_SHORT_TARGET": target, "ZTATE_SHORT_THREAD": thread_id}
    finally:
        await running.stop(grace=1.0)


@pytest.fixture(scope="module")
def example(installed: Path) -> Path:
    if not (EXAMPLE / "node_modules" / "@ztate" / "worker").exists():
        npm(EXAMPLE, "ci")
    npm(EXAMPLE, "run", "build")
    return EXAMPLE


async def test_the_typescript_client_passes_its_suite_against_the_service(
    installed: Path,
    target: str,
    pki: Pki,
    settings: Settings,
    database_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every service of this test holds one WaitForOutcome call at most 1 s (60 s in
    # production), so that the suite sees waitForOutcome ask again
    monkeypatch.setattr(decisions, "MAX_WAIT_SECONDS", 1.0)
    thread_id, runner_thread = new_thread_id(), new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        await operator.create_thread(runner_thread, INITIAL, policy="pipeline")
    creds, stranger = pki.node("input-parser"), pki.foreign("input-parser")
    expired, planner = pki.expired("input-parser"), pki.node("planner")
    admin = pki.operator()
    # a certificate of its own, revoked by serial in the service's revocation list
    revoked = ca.issue(pki.ca_dir, Identity(TRUST_DOMAIN, Role.NODE, "input-parser"), tmp_path)
    assert settings.revocation_list_file is not None
    listed = str(settings.revocation_list_file)
    assert ztate(["ca", "revoke", "--cert", str(revoked.cert), "--list", listed]) == 0
    environment = {
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
        "ZTATE_DOWN_TARGET": f"localhost:{free_port()}",  # just free: nothing listens
        "ZTATE_PLANNER_CERT": str(planner.cert),
        "ZTATE_PLANNER_KEY": str(planner.key),
        "ZTATE_THREAD": thread_id,
        "ZTATE_RUNNER_THREAD": runner_thread,
        "ZTATE_OPERATOR_CERT": str(admin.cert),
        "ZTATE_OPERATOR_KEY": str(admin.key),
        # a scripted service's (test/replies.test.ts): replies the protocol does not allow
        "ZTATE_SERVICE_CERT": str(pki.certs / "service-transition.crt"),
        "ZTATE_SERVICE_KEY": str(pki.certs / "service-transition.key"),
        "ZTATE_INITIAL": json.dumps(INITIAL),
    }
    # the approval path end to end: a transition service and an approval service of
    # their own that know each other (receipts delivered, heads checkpointed); and a
    # transition service whose watch streams end after 1.5 s, for the runner's re-watch
    async with (
        approval_pair(settings, database_dsn, pki, tmp_path / "pair") as pair,
        short_lived_streams(settings, database_dsn, pki) as short,
    ):
        async with client(pair["ZTATE_PAIR_TARGET"], pki.operator()) as operator:
            approval_thread = new_thread_id()
            await operator.create_thread(approval_thread, INITIAL, policy="pipeline")
        assert NPM is not None
        process = await asyncio.create_subprocess_exec(
            NPM,
            "test",
            "--silent",
            cwd=installed,
            env={
                **os.environ,
                **environment,
                **pair,
                **short,
                "ZTATE_APPROVAL_THREAD": approval_thread,
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
    assert counts["pass"] >= 65, report


async def test_the_typescript_example_worker_uses_only_the_package(
    example: Path, target: str, pki: Pki
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    creds = pki.node("input-parser")
    assert NODE is not None
    view, committed, refused = await run_example_worker(
        NODE, str(example / "dist" / "worker.js"), target, creds, thread_id
    )
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
