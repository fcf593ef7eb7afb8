"""``read_policies`` of a bundle holds at most one bounded line in memory: a
``policies.jsonl`` line too long to hold a policy the verifier would read is hashed and
counted, however long, and reported as that line of the file (it has no digest the
verifier read, so none is ever shown for it)."""

from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

from ztate.services.verify.bundle import MAX_POLICY_LINE, POLICIES, Manifest, read_policies
from ztate.services.verify.checks import BUNDLE_LINE, Finding, Trust, admit_policy_versions

LONG = 10 * MAX_POLICY_LINE  # 40 MiB without a newline until its end


def policies_only(lines: int, sha256: str) -> Manifest:
    """The manifest of a bundle of ``lines`` policy lines (with that SHA-256) and nothing else."""
    return Manifest(
        created_at="2026-11-25T00:00:00Z",
        thread_id=None,
        threads=0,
        records=0,
        records_sha256="0" * 64,
        policy_digests=(),
        heads={},
        policies=lines,
        policies_sha256=sha256,
    )


def test_an_over_long_policy_line_is_measured_without_being_held(tmp_path: Path) -> None:
    short = b'{"not": "a policy"}\n'
    with (tmp_path / POLICIES).open("wb") as out:
        chunk = b"x" * (1 << 20)
        for _ in range(LONG // len(chunk)):
            out.write(chunk)
        out.write(b"\n")
        out.write(short)
    hasher = hashlib.sha256()
    with (tmp_path / POLICIES).open("rb") as whole:
        while block := whole.read(1 << 20):
            hasher.update(block)
    manifest = policies_only(2, hasher.hexdigest())
    findings: list[Finding] = []

    tracemalloc.start()
    try:
        versions = read_policies(tmp_path, manifest, findings.append)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 3 * MAX_POLICY_LINE, f"{peak} bytes at the peak"  # it held 40 MiB
    assert versions == []
    # both lines are no policy version: said as such; the hash and count agree
    [long, short_line] = findings
    assert long.found == f"{POLICIES} line 1: too long (over {MAX_POLICY_LINE} bytes): not read"
    assert short_line.check == "bundle.line"
    assert short_line.found.startswith(f"{POLICIES} line 2: ")


def test_an_over_long_policy_line_is_reported_as_that_line_never_as_a_digest(
    tmp_path: Path,
) -> None:
    line = b"x" * MAX_POLICY_LINE + b"\n"  # one byte over, with its newline
    (tmp_path / POLICIES).write_bytes(line)
    manifest = policies_only(1, hashlib.sha256(line).hexdigest())
    findings: list[Finding] = []

    versions = read_policies(tmp_path, manifest, findings.append)
    admit_policy_versions(Trust(None, {}, []), versions, findings.append)  # as a bundle's are

    assert findings == [
        Finding(
            None,
            None,
            BUNDLE_LINE,
            "a policy version",
            f"policies.jsonl line 1: too long (over {MAX_POLICY_LINE} bytes): not read",
        )
    ]
    assert MAX_POLICY_LINE == 4 * 1024 * 1024
