"""A ledger that spans a policy edit verifies, from the database and from a bundle
(issue 13, second hole).

The service keeps the exact body of every policy version it loads in
``ztate.policies``; bundles carry the versions their records name; ``ztate
verify`` checks each record against the version it names, whatever version
``--policy`` gives. A stored body that is not the policy its digest names, and a
record naming a digest no source knows, are precise findings.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import Pki, client, fresh_database
from tests.integration.test_verify import World, cli_env, open_world, ztate
from ztate.contract.canonical import sha256_hex
from ztate.contract.keyring import generate_signing_key, load_public_keys
from ztate.services.policy.model import Policy, PolicySet
from ztate.services.verify.bundle import (
    BUNDLE_HASH,
    MANIFEST,
    MANIFEST_SIG,
    POLICIES,
    RECORDS,
    export_bundle,
    verify_bundle,
)
from ztate.services.verify.checks import (
    MAX_POLICY_BODY,
    POLICY,
    POLICY_BODY,
    Finding,
    Trust,
    verify_database,
)
from ztate.transition_service.app import start

VERSIONS_BEFORE_EDIT = 5  # what World.thread writes


@dataclass
class Edited:
    """A ledger written under version 1 of the pipeline policy, then version 2."""

    world: World
    v1: Policy
    v2: Policy
    v2_only: Path  # a folder with version 2 alone (what the service now loads)
    both: Path  # a folder with both versions, under two file names
    spanning: str  # a thread with records under both versions
    after: str  # a thread written under version 2 only

    def trust(self) -> Trust:
        """Keys, and version 2 of the policy alone, as an auditor given today's files."""
        world = self.world
        public = load_public_keys(world.settings.approval_public_keys_file)  # type: ignore[arg-type]
        return Trust(world.keyring, public, PolicySet.load(self.v2_only))


def edit_policy(source: Path, target: Path) -> None:
    """Version 2: the input parser may send larger patches, and the description says so."""
    text = source.read_text()
    edited = text.replace("max_patch_bytes: 4096", "max_patch_bytes: 8192", 1)
    edited = edited.replace(
        "description: input parser", "description: (v2, larger parser patches) input parser", 1
    )
    assert edited != text
    target.write_text(edited)


@pytest_asyncio.fixture(scope="module")
async def edited(
    postgres_server_dsn: str,
    pki: Pki,
    keyring_file: Path,
    policy_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Edited]:
    root = tmp_path_factory.mktemp("policy-versions")
    v1_dir, v2_dir, both = root / "v1", root / "v2", root / "both"
    shutil.copytree(policy_dir, v1_dir)
    shutil.copytree(policy_dir, v2_dir)
    edit_policy(v1_dir / "pipeline.yaml", v2_dir / "pipeline.yaml")
    both.mkdir()
    shutil.copyfile(v1_dir / "pipeline.yaml", both / "pipeline-v1.yaml")
    shutil.copyfile(v2_dir / "pipeline.yaml", both / "pipeline-v2.yaml")
    world = await open_world(
        await fresh_database(postgres_server_dsn), pki, keyring_file, v1_dir, root
    )
    try:
        spanning = await world.thread()
    finally:
        await world.service.stop(grace=1.0)
    # the same database, the service restarted on the edited policy
    world.settings = world.settings.model_copy(update={"policy_path": v2_dir})
    world.service = await start(world.settings, dsn=world.dsn)
    try:
        async with client(world.target, pki.node("input-parser")) as parser:
            await parser.propose(
                spanning, VERSIONS_BEFORE_EDIT - 1, {"requested_action": {"action": "none"}}
            )
        after = await world.thread()
    finally:
        await world.service.stop(grace=1.0)
    v1, v2 = Policy.load(v1_dir / "pipeline.yaml"), Policy.load(v2_dir / "pipeline.yaml")
    assert v1.digest != v2.digest
    yield Edited(world, v1, v2, v2_dir, both, spanning, after)


def where(findings: list[Finding]) -> list[tuple[str | None, int | None, str]]:
    return [(f.thread_id, f.version, f.check) for f in findings]


async def test_the_service_keeps_every_policy_version_it_loaded(edited: Edited) -> None:
    conn = await asyncpg.connect(edited.world.dsn)
    try:
        rows = await conn.fetch(
            "SELECT policy_digest, policy_name, body FROM ztate.policies ORDER BY loaded_at"
        )
    finally:
        await conn.close()
    kept = {row["policy_digest"]: (row["policy_name"], bytes(row["body"])) for row in rows}
    assert kept[edited.v1.digest] == ("pipeline", edited.v1.body)
    assert kept[edited.v2.digest] == ("pipeline", edited.v2.body)
    for digest, (_, body) in kept.items():
        assert sha256_hex(body) == digest  # the one definition of the policy digest


async def test_a_ledger_spanning_a_policy_edit_verifies_from_the_database(edited: Edited) -> None:
    findings: list[Finding] = []
    summary = await verify_database(edited.world.dsn, edited.trust(), findings.append)
    assert findings == []
    assert (summary.threads, summary.records) == (2, 2 * VERSIONS_BEFORE_EDIT + 1)
    # the command: today's policy alone, then a folder with both versions of "pipeline"
    for policy in (edited.v2_only, edited.both):
        code, lines, err = await ztate(edited.world, "verify", "--policy", str(policy), "--json")
        assert (code, lines[-1]["failures"]) == (0, 0), (lines, err)
        code, lines, err = await ztate(
            edited.world, "verify", "--policy", str(policy), "--jobs", "2", "--json"
        )
        assert (code, lines[-1]["failures"]) == (0, 0), (lines, err)
    # one thread created under version 1, given version 2: the policy, by name
    code, lines, err = await ztate(
        edited.world,
        "verify",
        "--policy",
        str(edited.v2_only),
        "--thread",
        edited.spanning,
        "--json",
    )
    assert (code, lines[-1]["records"], lines[-1]["failures"]) == (0, 6, 0), (lines, err)


async def test_a_ledger_spanning_a_policy_edit_verifies_from_a_bundle(
    edited: Edited, tmp_path: Path
) -> None:
    folder = tmp_path / "bundle"
    # the export runs beside the checkpoint key: it signs the manifest
    keys = edited.world.root / "cli-home" / "keys"
    if not (keys / "checkpoint-signing.pem").exists():
        generate_signing_key(
            keys / "checkpoint-signing.pem", keys / "checkpoint-public.json", "checkpoint-k1"
        )
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("ztate")),
        "ledger",
        "export",
        "--out",
        str(folder),
        env={**cli_env(edited.world)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out_bytes, err_bytes = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err_bytes
    assert "manifest signed with checkpoint key 'checkpoint-k1'" in out_bytes.decode()
    lines = [json.loads(line) for line in (folder / POLICIES).read_text().splitlines()]
    assert [(line["policy_digest"], line["policy_name"]) for line in lines] == sorted(
        [(edited.v1.digest, "pipeline"), (edited.v2.digest, "pipeline")]
    )
    assert {line["body"].encode() for line in lines} == {edited.v1.body, edited.v2.body}
    # owner-only: a bundle holds full state bodies
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for member in folder.iterdir():
        assert stat.S_IMODE(member.stat().st_mode) == 0o600, member.name
    findings: list[Finding] = []
    summary = verify_bundle(folder, edited.trust(), findings.append)
    assert findings == []
    assert summary.records == 2 * VERSIONS_BEFORE_EDIT + 1
    for jobs in ("1", "2"):
        code, out, err = await ztate(
            edited.world,
            "verify",
            "--bundle",
            str(folder),
            "--policy",
            str(edited.v2_only),
            "--signed-manifest",
            "--jobs",
            jobs,
            "--json",
        )
        assert (code, out[-1]["failures"]) == (0, 0), (out, err)
    # the manifest edited (a truncated bundle's packing list, say): its signature fails
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["records"] -= 1
    (folder / MANIFEST).write_text(json.dumps(manifest))
    code, out, _ = await ztate(edited.world, "verify", "--bundle", str(folder), "--json")
    assert code == 1
    assert [(f["thread_id"], f["version"], f["check"]) for f in out[:-1]] == [
        (None, None, "bundle.manifest"),
        (None, None, "bundle.count"),
    ]
    (folder / MANIFEST_SIG).unlink()
    code, out, _ = await ztate(
        edited.world, "verify", "--bundle", str(folder), "--signed-manifest", "--json"
    )
    assert [(f["thread_id"], f["version"], f["check"]) for f in out[:-1]] == [
        (None, None, "bundle.manifest"),
        (None, None, "bundle.count"),
    ]
    assert out[0]["found"] == "no manifest.sig"


def v1_records(edited: Edited) -> list[tuple[str | None, int | None, str]]:
    """Where each record naming version 1 is: every policy finding of a lost version."""
    return [(edited.spanning, version, POLICY) for version in range(VERSIONS_BEFORE_EDIT)]


async def test_an_altered_policy_body_in_a_bundle_is_a_precise_finding(
    edited: Edited, tmp_path: Path
) -> None:
    folder = tmp_path / "bundle"
    await export_bundle(edited.world.dsn, folder)
    policies = folder / POLICIES
    lines = [json.loads(line) for line in policies.read_text().splitlines()]
    for line in lines:
        if line["policy_digest"] == edited.v1.digest:
            line["body"] = line["body"].replace('max_patch_bytes":4096', 'max_patch_bytes":1')
            assert line["body"].encode() != edited.v1.body
    data = b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
    policies.write_bytes(data)
    findings: list[Finding] = []
    verify_bundle(folder, edited.trust(), findings.append)
    assert where(findings) == [
        (None, None, BUNDLE_HASH),
        (None, None, POLICY_BODY),
        *v1_records(edited),
    ]
    # the manifest rewritten to match: the body is still not the policy its digest names
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["policies_sha256"] = sha256_hex(data)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    findings = []
    verify_bundle(folder, edited.trust(), findings.append)
    assert where(findings) == [(None, None, POLICY_BODY), *v1_records(edited)]
    assert findings[0].found.startswith("a body hashing to ")
    # given by the auditor, version 1 verifies the records whatever the bundle holds
    findings = []
    both = Trust(edited.world.keyring, edited.trust().approval_keys, [edited.v1, edited.v2])
    verify_bundle(folder, both, findings.append)
    assert where(findings) == [(None, None, POLICY_BODY)]
    assert (folder / RECORDS).exists()


async def test_an_altered_or_missing_policy_version_in_the_database_is_a_precise_finding(
    edited: Edited,
) -> None:
    world = edited.world
    altered = edited.v1.body.replace(b'"max_patch_bytes":4096', b'"max_patch_bytes":1')
    assert altered != edited.v1.body
    statement = "UPDATE ztate.policies SET body = $1 WHERE policy_digest = $2"
    await world.tamper(edited.spanning, (statement, (altered, edited.v1.digest)))
    findings: list[Finding] = []
    summary = await verify_database(world.dsn, edited.trust(), findings.append)
    assert where(findings) == [(None, None, POLICY_BODY), *v1_records(edited)]
    assert findings[0].found == f"a body hashing to {sha256_hex(altered)}"
    assert summary.failures == 1 + VERSIONS_BEFORE_EDIT
    # removed: each record naming it names a digest no source knows
    await world.tamper(
        edited.spanning,
        ("DELETE FROM ztate.policies WHERE policy_digest = $1", (edited.v1.digest,)),
    )
    findings = []
    await verify_database(world.dsn, edited.trust(), findings.append)
    assert where(findings) == v1_records(edited)
    assert findings[0].found == edited.v1.digest
    # the command agrees, and the version given with --policy repairs the verdict
    code, lines, _ = await ztate(world, "verify", "--policy", str(edited.v2_only), "--json")
    assert code == 1
    assert [(line["thread_id"], line["version"], line["check"]) for line in lines[:-1]] == (
        v1_records(edited)
    )
    code, lines, _ = await ztate(world, "verify", "--policy", str(edited.both), "--json")
    assert (code, lines[-1]["failures"]) == (0, 0)
    # put it back for any later test of the module
    await world.tamper(
        edited.spanning,
        (
            "INSERT INTO ztate.policies (policy_digest, policy_name, body) VALUES ($1, $2, $3)",
            (edited.v1.digest, "pipeline", edited.v1.body),
        ),
    )


async def test_a_stored_policy_too_large_to_read_is_a_finding_not_a_burden(
    edited: Edited,
) -> None:
    """Whoever controls the database must not make the verifier parse megabytes."""
    world = edited.world
    huge = b"x" * (MAX_POLICY_BODY + 1)
    digest = sha256_hex(huge)
    await world.tamper(
        edited.spanning,
        (
            "INSERT INTO ztate.policies (policy_digest, policy_name, body) VALUES ($1, $2, $3)",
            (digest, "pipeline", huge),
        ),
    )
    try:
        findings: list[Finding] = []
        await verify_database(world.dsn, edited.trust(), findings.append)
        assert where(findings) == [(None, None, POLICY_BODY)]
        assert findings[0].found == (
            f"a body of {MAX_POLICY_BODY + 1} bytes (more than {MAX_POLICY_BODY}: not read)"
        )
    finally:
        await world.tamper(
            edited.spanning, ("DELETE FROM ztate.policies WHERE policy_digest = $1", (digest,))
        )
