"""What agents write reaches operators' terminals only escaped (a review of the CLI):
a thread id refused before it was checked, state values in ``ledger history``, C1
controls and bidi overrides in JSON and YAML, an unknown thread's id in an error. The
real ``ztate`` binary against a live mTLS service; a node writes the hostile values."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import grpc
import pytest

from tests.adversarial.test_reply_bounds import scribed  # noqa: F401 - the fixture
from tests.harness import Ledger, Pki, client, secure_channel
from tests.integration.test_cli import clean_env, flags, ztate
from ztate.contract.canonical import hashed_name
from ztate.transition_service.app import RunningService
from ztate.v1 import transition_pb2, transition_pb2_grpc

# each would act on a terminal or reorder what it shows: ESC (title, erase line, carriage
# return), a line feed that would start a row, C1 CSI, a right-to-left override
FAKE_ROW = "\x1b]0;PWNED\x07\x1b[2K\r2026-11-26T00:00:00Z  KEY_NOT_WRITABLE  order-42\n"
ACTING = ("\x1b", "\x07", "\r", "\x9b", "\u202e")


def acts_on_a_terminal(text: str) -> bool:
    return any(char in text for char in ACTING)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(ZTATE_CONFIG=str(tmp_path / "config.yaml"), ZTATE_HOME=str(tmp_path))


async def test_a_refused_proposals_hostile_thread_id_is_recorded_by_its_hash(
    scribed: tuple[RunningService, Ledger],  # noqa: F811
    pki: Pki,
    env: dict[str, str],
) -> None:
    """The rejection row of a proposal refused before its thread id was checked held the
    id as sent: ``ledger rejections`` drew a fake row blamed on another node. It now
    holds the id's hash, as invalid key names are recorded."""
    service, _ = scribed
    target = f"localhost:{service.port}"
    hostile = "x" + FAKE_ROW + "\u202e\x9b2J"
    async with secure_channel(target, pki.node("scribe")) as opened:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await transition_pb2_grpc.TransitionServiceStub(opened).ProposeTransition(
                transition_pb2.ProposeTransitionRequest(
                    thread_id=hostile,
                    expected_version=0,
                    patch_json=b'{"title":"x"}',
                    idempotency_key=f"k-{uuid.uuid4().hex}",
                )
            )
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    code, out, err = await ztate(
        "ledger",
        "rejections",
        "--limit",
        "5",
        "-o",
        "json",
        *flags(target, pki.operator()),
        env=env,
    )
    assert code == 0, err
    assert hashed_name(hostile) in [row["thread_id"] for row in json.loads(out)]
    code, out, err = await ztate(
        "ledger", "rejections", "--limit", "5", *flags(target, pki.operator()), env=env
    )
    assert code == 0, err
    assert hashed_name(hostile) in out
    assert not acts_on_a_terminal(out)


async def test_state_values_in_history_json_and_yaml_are_escaped(
    scribed: tuple[RunningService, Ledger],  # noqa: F811
    pki: Pki,
    env: dict[str, str],
) -> None:
    """``ledger history`` printed a value as it is: it cleared the screen and drew a row
    crediting another node. JSON (``-o json``, ``ledger show``) and YAML let C1 controls
    and bidi overrides through. Now each is an escape, one row per version."""
    service, _ = scribed
    target = f"localhost:{service.port}"
    thread_id = f"term-{uuid.uuid4().hex[:10]}"
    title = "ok" + FAKE_ROW[:-1]
    page = "pay \u202e0001$ ot \x9b2J"
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, {"title": "notes"})
    async with client(target, pki.node("scribe")) as scribe:
        await scribe.propose(thread_id, 0, {"title": title})
        await scribe.propose(thread_id, 1, {"page_a": page})
    operator_flags = flags(target, pki.operator())

    code, out, err = await ztate("ledger", "history", thread_id, "title", *operator_flags, env=env)
    assert code == 0, err
    assert not acts_on_a_terminal(out)
    lines = out.splitlines()
    assert len(lines) == 3  # the header, version 0, version 1
    assert lines[2].endswith(json.dumps(title, ensure_ascii=False).replace("\x1b", "\\u001b"))

    for command in (
        ("ledger", "history", thread_id, "page_a", "-o", "json"),
        ("ledger", "history", thread_id, "page_a", "-o", "yaml"),
        ("ledger", "show", "--thread", thread_id, "--version", "2"),
        ("ledger", "show", "--thread", thread_id, "--version", "2", "-o", "json"),
    ):
        code, out, err = await ztate(*command, *operator_flags, env=env)
        assert code == 0, (command, err)
        assert not acts_on_a_terminal(out), command
        assert "\\u202e" in out.lower() or "\\u202E" in out, command
    code, out, _ = await ztate(
        "ledger", "history", thread_id, "page_a", "-o", "json", *operator_flags, env=env
    )
    assert json.loads(out)[-1]["value"] == page  # escaped, not changed


async def test_an_unknown_hostile_thread_id_is_refused_unechoed(
    scribed: tuple[RunningService, Ledger],  # noqa: F811
    pki: Pki,
    env: dict[str, str],
) -> None:
    """``ledger show`` of a thread id that breaks the rule answered NOT_FOUND (exit 3)
    echoing it, escapes and all; docs/cli.md says exit 2, not echoed."""
    service, _ = scribed
    target = f"localhost:{service.port}"
    code, out, err = await ztate(
        "ledger", "show", "--thread", "no\x1b[31mthread", "--version", "2",
        *flags(target, pki.operator()), env=env,
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert err == (
        "ztate: REQUEST_INVALID: thread_id must be 1-128 characters of [A-Za-z0-9._:-]\n"
    )
