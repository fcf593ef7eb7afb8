"""The protos document themselves (issue 14): what a worker in another language reads.

- a field marked ``(google.api.field_behavior) = REQUIRED`` says "Required." in its
  comment, and a comment that says "Required." is marked, so the mark a generator sees
  and the text a person reads agree;
- the vendored google protos are byte-for-byte those of the googleapis-common-protos
  package the Python code decodes with (proto/google/README.md);
- no file names a Go package (``go_package``) that does not exist: Go users choose
  theirs in buf.gen.yaml (managed mode).
"""

from __future__ import annotations

import re
from pathlib import Path

import google.api
import pytest
from google.api import field_behavior_pb2
from google.protobuf import descriptor_pb2

from ztate.v1 import approval_pb2, errors_pb2, ledger_pb2, transition_pb2

PROTO = Path(__file__).resolve().parents[2] / "proto"
SOURCES = sorted((PROTO / "ztate" / "v1").glob("*.proto"))
MODULES = (approval_pb2, errors_pb2, ledger_pb2, transition_pb2)
VENDORED = ("rpc/status.proto", "rpc/error_details.proto", "rpc/code.proto")
FIELD = re.compile(r"^\s*(?:repeated\s+)?[\w.]+\s+(\w+)\s*=\s*\d+")


def commented_required(path: Path) -> dict[str, set[str]]:
    """Per message, the fields whose comment block starts with "Required."."""
    found: dict[str, set[str]] = {}
    message = ""
    comment: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("message "):
            message = stripped.split()[1]
        if stripped.startswith("//"):
            comment.append(stripped[2:].strip())
            continue
        match = FIELD.match(line)
        if match and comment and comment[0].startswith("Required."):
            found.setdefault(message, set()).add(match.group(1))
        comment = []
    return found


def marked_required() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for module in MODULES:
        for message in module.DESCRIPTOR.message_types_by_name.values():
            proto = descriptor_pb2.DescriptorProto()
            message.CopyToProto(proto)
            for field in proto.field:
                behaviors = field.options.Extensions[field_behavior_pb2.field_behavior]
                if field_behavior_pb2.REQUIRED in behaviors:
                    found.setdefault(message.name, set()).add(field.name)
    return found


def test_required_fields_are_marked_and_said_so() -> None:
    commented: dict[str, set[str]] = {}
    for path in SOURCES:
        commented.update(commented_required(path))
    marked = marked_required()
    assert marked == commented
    assert marked["ProposeTransitionRequest"] == {"thread_id", "patch_json", "idempotency_key"}


@pytest.mark.parametrize("name", [*VENDORED, "api/field_behavior.proto"])
def test_the_vendored_google_protos_are_the_installed_ones(name: str) -> None:
    installed = Path(next(iter(google.api.__path__))).parent / name
    vendored = PROTO / "google" / name
    assert vendored.read_bytes() == installed.read_bytes()
    assert b"Licensed under the Apache License, Version 2.0" in vendored.read_bytes()


def test_no_file_names_a_go_package() -> None:
    for path in SOURCES:
        assert "go_package" not in path.read_text(encoding="utf-8"), path.name
