"""``ztate console`` connects as every client command does (services/cli/context.py):
flags, then the environment, then the current context, then ``$ZTATE_HOME/certs``.

Real processes against the session's transition service (real gRPC, mTLS, Postgres):
the context is written by ``ztate context set``, and the console, started with no
connection flag and an empty ``$ZTATE_HOME``, shows a thread through it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.harness import INITIAL, Pki, act, client, console_session, new_thread_id
from ztate.services.cli.context import CLIENT_HINT
from ztate.services.console.command import REVIEWER_HINT
from ztate.services.runtime.identity import Role

ZTATE = str(Path(sys.executable).with_name("ztate"))
URL = re.compile(r"(http://[0-9a-f]{32}\.localhost:(\d+))/\?token=([A-Za-z0-9_-]{43})")


def clean_env(tmp_path: Path) -> dict[str, str]:
    """No ZTATE_* of the caller's: an empty home, and a context file of this test's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    (tmp_path / "home").mkdir()
    env.update(ZTATE_HOME=str(tmp_path / "home"), ZTATE_CONFIG=str(tmp_path / "config.yaml"))
    return env


async def ztate(env: dict[str, str], *argv: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        ZTATE, *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest_asyncio.fixture
async def console_of_context(
    tmp_path: Path, target: str, pki: Pki
) -> AsyncIterator[tuple[str, str]]:
    """A console started with no flag but --port, after ``ztate context set ... --use``
    named the service and the operator's certificate: its origin and one-time token."""
    env = clean_env(tmp_path)
    operator = pki.operator()
    code, _, err = await ztate(
        env,
        "context",
        "set",
        "ops",
        *("--address", target, "--approval-address", "127.0.0.1:1"),
        *("--client-cert", str(operator.cert), "--client-key", str(operator.key)),
        *("--ca-cert", str(operator.ca), "--use"),
    )
    assert code == 0, err
    process = await asyncio.create_subprocess_exec(
        ZTATE,
        "console",
        "--port",
        "0",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        if not line:
            pytest.fail(f"ztate console stopped: {(await process.stderr.read()).decode()}")
        found = URL.search(line)
        assert found, line
        yield found.group(1), found.group(3)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)


async def test_the_console_connects_through_the_current_context(
    console_of_context: tuple[str, str], target: str, pki: Pki
) -> None:
    thread_id = f"ctx-{new_thread_id()[:12]}"
    async with (
        client(target, pki.operator()) as operator,
        client(target, pki.node("input-parser")) as parser,
    ):
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        await parser.propose(thread_id, 0, {"requested_action": act("ctx")})
    origin, token = console_of_context
    async with console_session() as session:
        async with session.get(f"{origin}/?token={token}", allow_redirects=False) as got:
            assert got.status == 303
        async with session.get(f"{origin}/threads/{thread_id}") as got:
            page = await got.text()
            assert got.status == 200, page
    assert thread_id in page
    assert "input-parser" in page  # version 1's node, read with the context's certificate


async def test_flags_and_environment_come_before_the_context(tmp_path: Path, pki: Pki) -> None:
    """As for every client command: a flag over the environment over the context; the
    files that cannot be read are named as resolved (exit 2, nothing served)."""
    env = clean_env(tmp_path)
    operator = pki.operator()
    code, _, err = await ztate(
        env,
        "context",
        "set",
        "ops",
        *("--address", "127.0.0.1:1", "--client-cert", "/ctx/ana.crt"),
        *("--client-key", "/ctx/ana.key", "--ca-cert", str(operator.ca), "--use"),
    )
    assert code == 0, err
    code, out, err = await ztate(env, "console", "--port", "0")
    assert (code, out) == (2, "")
    assert err.startswith("ztate console: cannot read /ctx/ana.crt, /ctx/ana.key\n"), err
    env["ZTATE_CERT"] = "/env/ana.crt"
    code, _, err = await ztate(env, "console", "--port", "0", "--client-key", "/flag/ana.key")
    assert code == 2
    # the reviewer side keeps the context's key: --client-key is the operator's
    assert err.startswith(
        "ztate console: cannot read /env/ana.crt, /flag/ana.key, /ctx/ana.key\n"
    ), err
    code, _, err = await ztate(env, "console", "--context", "nope")
    assert code == 2
    assert "no context 'nope'" in err, err


async def test_credentials_gone_while_running_is_503_with_a_fixed_text(
    tmp_path: Path, target: str, pki: Pki
) -> None:
    """The console's key file removed while it runs: its pages answer 503 with a fixed
    text (not 500), and the log names only the type of the failure, not the path."""
    operator, reviewer = pki.operator(), pki.identity(Role.REVIEWER, "alice")
    mine = tmp_path / "creds"
    mine.mkdir()
    for source in (operator.cert, operator.key, operator.ca, reviewer.cert, reviewer.key):
        (mine / source.name).write_bytes(source.read_bytes())
    key = mine / operator.key.name
    env = clean_env(tmp_path)
    process = await asyncio.create_subprocess_exec(
        ZTATE,
        "console",
        "--port",
        "0",
        *("--address", target, "--approval-address", "127.0.0.1:1"),
        *("--client-cert", str(mine / operator.cert.name), "--client-key", str(key)),
        *("--ca-cert", str(mine / operator.ca.name)),
        *("--reviewer-cert", str(mine / reviewer.cert.name)),
        *("--reviewer-key", str(mine / reviewer.key.name)),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        if not line:
            pytest.fail(f"ztate console stopped: {(await process.stderr.read()).decode()}")
        found = URL.search(line)
        assert found, line
        origin, token = found.group(1), found.group(3)
        async with console_session() as session:
            async with session.get(f"{origin}/?token={token}", allow_redirects=False) as got:
                assert got.status == 303
            async with session.get(f"{origin}/threads") as got:
                assert got.status == 200, await got.text()
            key.unlink()  # the key file disappears while the console runs
            async with session.get(f"{origin}/threads") as got:
                page = await got.text()
                assert got.status == 503, page
            assert "the console cannot read its credentials" in page
            assert str(key) not in page
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)
    assert process.stderr is not None
    logged = (await process.stderr.read()).decode()
    assert "console cannot read its credentials: FileNotFoundError" in logged, logged
    assert str(key) not in logged
    assert "Traceback" not in logged


async def test_credentials_present_but_unusable_are_refused_before_serving(
    tmp_path: Path, pki: Pki
) -> None:
    """A key that is not the certificate's, or a file that is not PEM, is refused at
    start as every client command refuses it (exit 2, nothing on stdout, nothing served),
    not discovered page by page as a 503."""
    env = clean_env(tmp_path)
    operator, reviewer = pki.operator(), pki.identity(Role.REVIEWER, "alice")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    flags = ("--port", "0", "--reviewer-cert", str(reviewer.cert), "--reviewer-key")
    code, out, err = await ztate(
        env,
        "console",
        *flags,
        str(reviewer.key),
        "--client-cert",
        str(operator.cert),
        "--client-key",
        str(reviewer.key),
        "--ca-cert",
        str(operator.ca),
    )
    assert (code, out) == (2, "")
    assert err == (
        f"ztate console: cannot use credentials: {reviewer.key} is not the key of "
        f"{operator.cert} {CLIENT_HINT}\n"
    )
    code, out, err = await ztate(
        env,
        "console",
        *flags,
        str(not_pem),
        "--client-cert",
        str(operator.cert),
        "--client-key",
        str(operator.key),
        "--ca-cert",
        str(operator.ca),
    )
    assert (code, out) == (2, "")
    # the reviewer's key: the reviewer's flags are named, not the operator's
    assert err == (
        f"ztate console: cannot use credentials: {not_pem} is not a PEM private key "
        f"{REVIEWER_HINT}\n"
    )
