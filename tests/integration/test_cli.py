"""The real ``ztate`` binary against a live service (issue 17): exit codes, the ``-o``
shapes, the connection context (environment and context file), a reader that stops
early, and ``ztate serve`` waiting for a database that comes up late."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit

import asyncpg
import pytest
import yaml

from tests.faults import ServedProcess, free_port
from tests.harness import INITIAL, Credentials, Pki, act, client, fresh_database, new_thread_id

ZTATE = Path(sys.executable).with_name("ztate")
PARSER = "spiffe://ztate.test/node/input-parser"


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any ztate setting, a context file or a home of the runner."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.pop("XDG_CONFIG_HOME", None)
    env.update(extra)
    return env


async def ztate(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def flags(target: str, creds: Credentials) -> list[str]:
    return [
        *("--address", target, "--client-cert", str(creds.cert)),
        *("--client-key", str(creds.key), "--ca-cert", str(creds.ca)),
    ]


@pytest.fixture
async def thread(target: str, pki: Pki) -> str:
    """A thread at version 2: genesis, then two writes of requested_action."""
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("one")})
        await parser.propose(thread_id, 1, {"requested_action": act("two")})
    return thread_id


async def test_one_json_shape_native_integers_and_nested_objects(
    target: str, pki: Pki, thread: str, tmp_path: Path
) -> None:
    env = clean_env(XDG_CONFIG_HOME=str(tmp_path))
    base = flags(target, pki.operator())
    code, out, err = await ztate("ledger", "list", "--thread", thread, "-o", "json", *base, env=env)
    assert code == 0, err
    rows = json.loads(out)
    assert [row["version"] for row in rows] == [2, 1, 0]  # numbers, and the genesis has one
    assert rows[-1]["kind"] == "genesis"
    assert set(rows[0]) == {
        "thread_id", "version", "digest", "parent_digest", "node_id", "kind", "status", "at",
        "changed_keys", "has_receipt",
    }  # fmt: skip
    # the same resource, the same shape, whichever command or format prints it
    code, out, err = await ztate("ledger", "list", "--thread", thread, "--json", *base, env=env)
    assert code == 0, err
    assert [json.loads(line) for line in out.splitlines()] == rows
    code, out, err = await ztate("ledger", "list", "--thread", thread, "-o", "yaml", *base, env=env)
    assert code == 0, err
    assert yaml.safe_load(out) == rows

    code, out, err = await ztate(
        "ledger", "show", "--thread", thread, "--version", "1", "-o", "json", *base, env=env
    )
    assert code == 0, err
    detail = json.loads(out)
    assert detail["entry"] == rows[1]
    assert detail["patch"] == {"requested_action": act("one")}  # an object, not JSON text
    assert detail["record"]["version"] == 1
    assert detail["state"]["requested_action"] == act("one")

    code, out, err = await ztate(
        "ledger", "history", thread, "requested_action", "-o", "json", *base, env=env
    )
    assert code == 0, err
    assert [(c["version"], c["value"], c["removed"]) for c in json.loads(out)] == [
        (1, act("one"), False),
        (2, act("two"), False),
    ]


async def test_tables_have_headers_and_node_takes_a_short_name(
    target: str, pki: Pki, thread: str, tmp_path: Path
) -> None:
    env = clean_env(XDG_CONFIG_HOME=str(tmp_path))
    base = flags(target, pki.operator())
    # the trust domain of a short --node comes from the operator's own certificate
    code, out, err = await ztate(
        "ledger", "list", "--thread", thread, "--node", "input-parser", *base, env=env
    )
    assert code == 0, err
    header, *lines = out.splitlines()
    assert header.split() == [
        "AT", "STATUS", "THREAD", "VERSION", "KIND", "DIGEST", "NODE", "KEYS", "RECEIPT",
    ]  # fmt: skip
    assert len(lines) == 2
    assert all(PARSER in line and thread in line for line in lines)


async def test_exit_codes(target: str, pki: Pki, thread: str, tmp_path: Path) -> None:
    env = clean_env(XDG_CONFIG_HOME=str(tmp_path))
    base = flags(target, pki.operator())
    # not found: 3, with what was not found
    code, out, err = await ztate("ledger", "history", "t-no-such-thread", "k", *base, env=env)
    assert (code, out) == (3, "")
    assert err == "ztate: no thread 't-no-such-thread'\n"
    # ... while a key a real thread never had is an empty answer
    code, out, err = await ztate("ledger", "history", thread, "never_set", *base, env=env)
    assert (code, out) == (0, "")
    assert "never_set never changed in" in err
    code, _, err = await ztate("ledger", "show", "--thread", thread, "--version", "9", *base,
                               env=env)  # fmt: skip
    assert code == 3, err
    # usage: 2, naming the accepted forms
    code, out, err = await ztate("ledger", "list", "--since", "yesterday", *base, env=env)
    assert (code, out) == (2, "")
    assert "RFC 3339" in err
    assert "2d" in err
    assert "Traceback" not in err
    code, out, err = await ztate("ledger", "list", "--since", "2d", *base, env=env)
    assert code == 0, err
    code, _, err = await ztate("ledger", "list", "--node", "Not A Name", *base, env=env)
    assert code == 2, err
    # unreadable credentials: a usage error naming the file
    code, _, err = await ztate(
        "ledger", "list", "--address", target, "--client-cert", str(tmp_path / "nope.crt"),
        env=env,
    )  # fmt: skip
    assert code == 2
    assert "nope.crt" in err
    # unreachable: 4
    closed = f"localhost:{free_port()}"
    code, _, err = await ztate("ledger", "list", *base, "--address", closed, env=env)
    assert code == 4
    assert err.startswith(f"ztate: {closed}: UNAVAILABLE")
    assert "Traceback" not in err


async def test_the_connection_context(target: str, pki: Pki, thread: str, tmp_path: Path) -> None:
    """Environment variables, then the context file: no connection flag needed."""
    creds = pki.operator()
    env = clean_env(ZTATE_HOME=str(tmp_path / "no-home"), XDG_CONFIG_HOME=str(tmp_path))
    listing = ("ledger", "list", "--thread", thread, "-o", "json")
    # nothing configured: the development layout's files are missing, a usage error
    code, _, err = await ztate(*listing, env=env)
    assert code == 2
    assert "operator-admin.crt" in err
    # the environment alone
    by_env = dict(
        env, ZTATE_ADDRESS=target, ZTATE_CERT=str(creds.cert), ZTATE_KEY=str(creds.key),
        ZTATE_CA=str(creds.ca),
    )  # fmt: skip
    code, out, err = await ztate(*listing, env=by_env)
    assert code == 0, err
    assert len(json.loads(out)) == 3
    # a context file, kubeconfig style
    code, out, err = await ztate(
        "context", "set", "test", "--address", target, "--client-cert", str(creds.cert),
        "--client-key", str(creds.key), "--ca-cert", str(creds.ca), env=env,
    )  # fmt: skip
    assert code == 0, err
    config = tmp_path / "ztate" / "config.yaml"
    assert yaml.safe_load(config.read_text()) == {
        "current-context": "test",
        "contexts": {
            "test": {
                "address": target, "cert": str(creds.cert), "key": str(creds.key),
                "ca": str(creds.ca),
            }
        },
    }  # fmt: skip
    assert config.stat().st_mode & 0o077 == 0
    code, _, err = await ztate(
        "context", "set", "elsewhere", "--address", f"localhost:{free_port()}",
        "--client-cert", str(creds.cert), "--client-key", str(creds.key),
        "--ca-cert", str(creds.ca), env=env,
    )  # fmt: skip
    assert code == 0, err
    code, out, err = await ztate("context", "list", "-o", "json", env=env)
    assert code == 0, err
    assert [(c["name"], c["current"]) for c in json.loads(out)] == [
        ("elsewhere", False),
        ("test", True),
    ]
    code, out, err = await ztate(*listing, env=env)
    assert code == 0, err
    assert len(json.loads(out)) == 3
    code, out, err = await ztate("context", "show", "-o", "json", env=env)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["context"] == "test"
    assert shown["transition"]["address"] == target
    assert shown["transition"]["sources"]["address"] == "context test"
    # the environment outranks the context; a flag outranks both
    closed = f"localhost:{free_port()}"
    code, _, err = await ztate(*listing, env=dict(env, ZTATE_ADDRESS=closed))
    assert code == 4, err
    code, _, err = await ztate(*listing, "--address", target,
                               env=dict(env, ZTATE_ADDRESS=closed))  # fmt: skip
    assert code == 0, err
    # choosing a context: --context, ZTATE_CONTEXT, `context use`
    code, _, err = await ztate(*listing, "--context", "elsewhere", env=env)
    assert code == 4, err
    code, _, err = await ztate(*listing, env=dict(env, ZTATE_CONTEXT="elsewhere"))
    assert code == 4, err
    code, _, err = await ztate(*listing, "--context", "nope", env=env)
    assert code == 2
    assert "no context 'nope'" in err
    code, _, err = await ztate("context", "use", "elsewhere", env=env)
    assert code == 0, err
    code, _, err = await ztate(*listing, env=env)
    assert code == 4, err
    # a context file that is not one: a usage error naming it, no traceback
    config.write_text("contexts: [1, 2]\n")
    code, _, err = await ztate(*listing, env=env)
    assert code == 2
    assert str(config) in err
    assert "Traceback" not in err


async def test_a_reader_that_stops_early_is_no_traceback(
    target: str, pki: Pki, thread: str, tmp_path: Path
) -> None:
    """``ztate ledger list -o json | head -1``: the pipe closes under the writer."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte is written
    try:  # the service runs in this process's event loop: never block it
        process = await asyncio.create_subprocess_exec(
            str(ZTATE), "ledger", "list", "--thread", thread, "-o", "json",
            *flags(target, pki.operator()),
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
            env=clean_env(XDG_CONFIG_HOME=str(tmp_path)),
        )  # fmt: skip
    finally:
        os.close(write_end)
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 141  # 128 + SIGPIPE, as any Unix tool
    assert stderr == b""


# --- ztate serve and a database that comes up late -----------------------------------------


async def forward(client: asyncio.StreamReader, to: asyncio.StreamWriter) -> None:
    try:
        while data := await client.read(65536):
            to.write(data)
            await to.drain()
    finally:
        to.close()


def tcp_dsn(server_dsn: str, port: int) -> tuple[str, tuple[str, ...]]:
    """The DSN of the same database through 127.0.0.1:``port``, and where Postgres really
    is: a Unix socket path, or a host and port."""
    parts = urlsplit(server_dsn)
    socket_dir = parse_qs(parts.query).get("host", [""])[0]
    user = parts.username or "postgres"
    dsn = urlunsplit(("postgresql", f"{user}@127.0.0.1:{port}", parts.path, "", ""))
    if socket_dir.startswith("/"):
        return dsn, (f"{socket_dir}/.s.PGSQL.{parts.port or 5432}",)
    return dsn, (parts.hostname or "localhost", str(parts.port or 5432))


async def test_serve_waits_for_a_database_that_comes_up_late(
    postgres_server_dsn: str, pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path
) -> None:
    port = free_port()
    dsn, real = tcp_dsn(await fresh_database(postgres_server_dsn), port)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(real) == 1:
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(real[0])
        else:
            upstream_reader, upstream_writer = await asyncio.open_connection(real[0], real[1])
        await asyncio.gather(forward(reader, upstream_writer), forward(upstream_reader, writer))

    service = ServedProcess(
        home=tmp_path / "home", dsn=dsn, pki=pki, policy=policy_dir, keyring=keyring_file
    )
    starting = asyncio.get_running_loop().create_task(service.start(within=90))
    database: asyncio.Server | None = None
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not service.logged("waiting for the database at 127.0.0.1:"):
            assert not starting.done(), b"".join(service.log).decode()
            assert loop.time() < deadline, "serve never said it was waiting"
            await asyncio.sleep(0.05)  # polling the log for a condition, with a deadline
        said = b"".join(service.log).decode()
        assert "connection refused" in said
        assert "Traceback" not in said
        database = await asyncio.start_server(relay, "127.0.0.1", port)  # the database is up
        await starting  # ... and the service listens
        assert service.logged("the database at 127.0.0.1:")
        assert await service.terminate() == 0
    finally:
        starting.cancel()
        await service.ensure_stopped()
        if database is not None:
            database.close()


@pytest.mark.parametrize(
    ("command", "prefix"),
    [("serve", "cannot start"), ("approval-serve", "cannot start the approval service")],
)
async def test_serve_gives_up_on_a_database_that_never_comes(
    pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path, command: str, prefix: str
) -> None:
    """Both services say it as they say every failure to start but a refusal (one
    implementation: services/cli/startup.py): exit 4, one line, no password."""
    port = free_port()
    service = ServedProcess(
        home=tmp_path / "home",
        dsn=f"postgresql://ztate:secret-password@127.0.0.1:{port}/ztate",
        pki=pki,
        policy=policy_dir,
        keyring=keyring_file,
    )
    code, out, err = await ztate(
        command, "--wait-for-database", "1", env=dict(service.env, ZTATE_LOG_FORMAT="text")
    )
    assert code == 4, err
    assert out == ""
    assert err.splitlines()[-1] == (
        f"ztate: {prefix}: the database at 127.0.0.1:{port} is not reachable "
        "(connection refused); gave up after 1s (ZTATE_DATABASE_WAIT_SECONDS or "
        "--wait-for-database)"
    )
    assert "waiting for the database" in err
    assert "secret-password" not in err
    assert "Traceback" not in err


SECRET = "pw-5ecret-9c1f"  # a password in the DSN: never printed


async def refused_start(command: str, env: dict[str, str]) -> str:
    """``ztate <command>`` that must refuse to start: exit 2, nothing on stdout, one line
    on stderr (never a traceback, never the DSN's password); that line."""
    code, out, err = await ztate(command, "--wait-for-database", "5", env=env)
    assert (code, out) == (2, ""), err
    assert "Traceback" not in err
    assert SECRET not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


async def service_env(
    server_dsn: str, pki: Pki, policy_dir: Path, keyring: Path, home: Path, **settings: str
) -> dict[str, str]:
    """``ztate serve``'s environment on a fresh database, with ``settings`` changed."""
    return ServedProcess(
        home=home,
        dsn=await fresh_database(server_dsn),
        pki=pki,
        policy=policy_dir,
        keyring=keyring,
        **settings,
    ).env


@pytest.mark.parametrize(
    ("what", "said"),
    [
        ("role", 'role "ztate_nobody" does not exist (InvalidAuthorizationSpecificationError)'),
        ("database", 'database "ztate_no_such_db" does not exist (InvalidCatalogNameError)'),
    ],
)
@pytest.mark.parametrize("command", ["serve", "approval-serve"])
async def test_serve_refused_by_the_database_says_so_in_one_line(
    postgres_server_dsn: str,
    pki: Pki,
    policy_dir: Path,
    keyring_file: Path,
    tmp_path: Path,
    what: str,
    said: str,
    command: str,
) -> None:
    """A real Postgres that refuses ``serve`` or ``approval-serve`` (a role it does not
    know, as a wrong password is refused: both are asyncpg's
    InvalidAuthorizationSpecificationError; a database that does not exist): one line,
    exit 2, no traceback, no password."""
    parts = urlsplit(postgres_server_dsn)
    host = parts.netloc.rpartition("@")[2]
    user = "ztate_nobody" if what == "role" else (parts.username or "postgres")
    database = "/ztate_no_such_db" if what == "database" else parts.path
    dsn = urlunsplit((parts.scheme, f"{user}:{SECRET}@{host}", database, parts.query, ""))
    service = ServedProcess(
        home=tmp_path / "home", dsn=dsn, pki=pki, policy=policy_dir, keyring=keyring_file
    )
    line = await refused_start(command, service.env)
    assert line == f"ztate: the database refused the connection: {said}"


async def test_a_database_that_is_full_is_waited_for_not_refused(
    postgres_server_dsn: str,
) -> None:
    """A server with no connection slot left (here: a role allowed none, the same
    TooManyConnectionsError as a full server) is a database not ready yet, as one that is
    starting or failing over: waited for until the budget runs out, then "not reachable"
    (exit 4), never "refused" (exit 2, a configuration error) at the first attempt."""
    from ztate.services.store.waiting import DatabaseNotReady, wait_for_database

    admin = await asyncpg.connect(postgres_server_dsn)
    try:
        await admin.execute("DROP ROLE IF EXISTS ztate_full")
        await admin.execute("CREATE ROLE ztate_full LOGIN CONNECTION LIMIT 0")
    finally:
        await admin.close()
    parts = urlsplit(postgres_server_dsn)
    host = parts.netloc.rpartition("@")[2]
    dsn = urlunsplit((parts.scheme, f"ztate_full:{SECRET}@{host}", parts.path, parts.query, ""))
    with pytest.raises(DatabaseNotReady) as waited:
        await wait_for_database(dsn, 0.5)
    assert str(waited.value).endswith(
        "is not reachable (TooManyConnectionsError); gave up after 0.5s "
        "(ZTATE_DATABASE_WAIT_SECONDS or --wait-for-database)"
    )
    assert SECRET not in str(waited.value)


async def test_serve_with_an_encrypted_tls_key_says_so_in_one_line(
    postgres_server_dsn: str, pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path
) -> None:
    """ztate reads private keys without a password (none is asked for): a key encrypted
    with one is refused in one line naming the file, exit 2, no traceback, no key."""
    from cryptography.hazmat.primitives import serialization

    plain = (pki.certs / "service-transition.key").read_bytes()
    key = serialization.load_pem_private_key(plain, password=None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(SECRET.encode()),
        )
    )
    env = await service_env(
        postgres_server_dsn, pki, policy_dir, keyring_file, tmp_path / "home", tls_key=str(locked)
    )
    line = await refused_start("serve", env)
    assert str(locked) in line
    assert "PRIVATE KEY" not in line


@pytest.mark.parametrize(
    "keyring",
    [
        pytest.param(b"not json " + SECRET.encode(), id="not JSON"),
        pytest.param(
            b'{"current": "k1", "keys": {"k1": "' + SECRET.encode() + b'"}}', id="short key"
        ),
        pytest.param(b'{"current": "k9", "keys": {}}', id="current missing"),
    ],
)
async def test_serve_with_a_keyring_it_cannot_use_says_so_in_one_line(
    postgres_server_dsn: str,
    pki: Pki,
    policy_dir: Path,
    tmp_path: Path,
    keyring: bytes,
) -> None:
    """The HMAC keyring is serve's other secret input: unusable, it is one line naming
    the file, exit 2, no traceback and none of the file's content."""
    path = tmp_path / "keyring.json"
    path.write_bytes(keyring)
    env = await service_env(postgres_server_dsn, pki, policy_dir, path, tmp_path / "home")
    line = await refused_start("serve", env)
    assert line.startswith("ztate: cannot start: ")


async def test_serve_with_a_setting_it_cannot_use_says_so_in_one_line(
    postgres_server_dsn: str, pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path
) -> None:
    """A setting that passes the settings' checks but that the service cannot use (an
    OTLP endpoint that is no URL: a ValueError at start-up) is one line, exit 2, no
    traceback, no password of the DSN."""
    env = await service_env(
        postgres_server_dsn,
        pki,
        policy_dir,
        keyring_file,
        tmp_path / "home",
        otlp_endpoint="http://[collector:4317",
    )
    assert await refused_start("serve", env) == "ztate: cannot start: Invalid IPv6 URL"


async def test_serve_with_a_key_it_cannot_read_says_so_in_one_line(
    postgres_server_dsn: str, pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path
) -> None:
    """A TLS key path that names a directory (an OSError that is not FileNotFoundError,
    as an unreadable file is for a non-root user) is one line, exit 2, no traceback."""
    (tmp_path / "key-dir").mkdir()
    env = await service_env(
        postgres_server_dsn,
        pki,
        policy_dir,
        keyring_file,
        tmp_path / "home",
        tls_key=str(tmp_path / "key-dir"),
    )
    line = await refused_start("serve", env)
    assert line.startswith("ztate: cannot start: ")
    assert "Is a directory" in line


def new_signing_key(home: Path) -> Path:
    """A new Ed25519 signing key in ``home`` (PEM, unencrypted), as approval-serve reads."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    home.mkdir(parents=True, exist_ok=True)
    path = home / "signing-key.pem"
    path.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


async def approval_env(
    server_dsn: str, pki: Pki, home: Path, **settings: str
) -> tuple[dict[str, str], str]:
    """``ztate approval-serve``'s environment on a fresh database (its own TLS files and
    a new Ed25519 signing key), with ``settings`` (``ZTATE_APPROVAL_<NAME>``) changed;
    and the database's DSN."""
    from ztate.services.runtime.identity import Role
    from ztate.testing import TRUST_DOMAIN

    signing_key = new_signing_key(home)
    service = pki.identity(Role.SERVICE, "approval")
    dsn = await fresh_database(server_dsn)
    env = clean_env(
        DATABASE_URL=dsn,
        ZTATE_HOME=str(home),
        ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
        ZTATE_APPROVAL_LISTEN=f"127.0.0.1:{free_port()}",
        ZTATE_APPROVAL_TLS_CERT=str(service.cert),
        ZTATE_APPROVAL_TLS_KEY=str(service.key),
        ZTATE_APPROVAL_TLS_CA=str(service.ca),
        ZTATE_APPROVAL_SIGNING_KEY_FILE=str(signing_key),
    )
    env.update({f"ZTATE_APPROVAL_{k.upper()}": v for k, v in settings.items()})
    return env, dsn


async def tables_in(dsn: str) -> list[str]:
    """The tables of the database, outside Postgres's own schemas."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT table_schema || '.' || table_name AS name FROM information_schema.tables "
            "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
        )
    finally:
        await conn.close()
    return [row["name"] for row in rows]


def encrypted_copy(key: Path, to: Path) -> Path:
    """``key`` written to ``to`` as PKCS #8 encrypted with the password ``SECRET``."""
    from cryptography.hazmat.primitives import serialization

    loaded = serialization.load_pem_private_key(key.read_bytes(), password=None)
    to.write_bytes(
        loaded.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(SECRET.encode()),
        )
    )
    return to


@pytest.mark.parametrize("setting", ["tls_key", "signing_key_file"])
async def test_approval_serve_with_an_encrypted_key_says_so_in_one_line(
    postgres_server_dsn: str, pki: Pki, tmp_path: Path, setting: str
) -> None:
    """approval-serve reads its TLS key and its signing key without a password: either
    encrypted with one is refused in one line naming the file (and nothing of the key,
    nor its password), exit 2, no traceback, before anything is written to the database."""
    env, dsn = await approval_env(postgres_server_dsn, pki, tmp_path / "home")
    variable = f"ZTATE_APPROVAL_{setting.upper()}"
    locked = encrypted_copy(Path(env[variable]), tmp_path / "locked.pem")
    env[variable] = str(locked)
    line = await refused_start("approval-serve", env)
    said = (
        f"{locked} is encrypted with a password: ztate reads private keys without one"
        if setting == "tls_key"
        else f"{locked}: not an unencrypted PEM private key"
    )
    assert line == f"ztate: cannot start the approval service: {said}"
    assert await tables_in(dsn) == []


@pytest.mark.parametrize(
    ("content", "said"),
    [
        pytest.param(
            b"not a key " + SECRET.encode(), "not an unencrypted PEM private key", id="not PEM"
        ),
        pytest.param(
            b"-----BEGIN PRIVATE KEY-----\n" + SECRET.encode() + b"\n-----END PRIVATE KEY-----\n",
            "not an unencrypted PEM private key",
            id="PEM of no key",
        ),
        pytest.param(b"P-256", "the signing key must be Ed25519", id="P-256"),
        pytest.param(b"secp112r1", "the signing key must be Ed25519", id="unsupported curve"),
    ],
)
async def test_approval_serve_with_a_signing_key_it_cannot_use_says_so_in_one_line(
    postgres_server_dsn: str, pki: Pki, tmp_path: Path, content: bytes, said: str
) -> None:
    """The signing key is approval-serve's key file (it holds no HMAC keyring): one it
    cannot use (no key, a key of another type, a key of a curve cryptography does not
    support) is one line naming the file, exit 2, no traceback, none of the file's
    content, and nothing written to the database."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from tests.unsupported_curve import secp112r1_key_pair

    if content == b"P-256":
        content = ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    elif content == b"secp112r1":
        content, _ = secp112r1_key_pair()
    env, dsn = await approval_env(postgres_server_dsn, pki, tmp_path / "home")
    bad = tmp_path / "signing-key.pem"
    bad.write_bytes(content)
    env["ZTATE_APPROVAL_SIGNING_KEY_FILE"] = str(bad)
    line = await refused_start("approval-serve", env)
    assert line == f"ztate: cannot start the approval service: {bad}: {said}"
    assert "PRIVATE KEY" not in line
    assert await tables_in(dsn) == []
