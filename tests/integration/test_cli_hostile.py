"""Hostile input to ``ztate threads create|list|show`` and ``ztate context use|set|delete``,
through the real ``ztate`` binary (against the live mTLS service for ``threads``): each
exits 2 (usage) or its documented code (3: a thread or context that does not exist) with
a precise one-line message, never a traceback, and writes nothing: no thread created, the
context file byte for byte as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import Pki, new_thread_id
from tests.integration.test_cli import ZTATE, clean_env, flags, ztate

THREAD_RULE = "thread_id must be 1-128 characters of [A-Za-z0-9._:-]"
NAME_RULE = (
    "not a context name: 1-128 characters of letters, digits and . _ : @ / -, "
    "the first a letter or digit"
)
NAME_TEXT = NAME_RULE.removeprefix("not a context name: ")
POLICY_RULE = (
    "not a policy name: 1-64 characters of a-z 0-9 . _ -, the first and last a letter or digit"
)
HOSTILE_IDS = [
    pytest.param("", id="empty"),
    pytest.param("t" * 129, id="one past the bound"),
    pytest.param("t" * 5000, id="long"),
    pytest.param("a\nb", id="newline"),
    pytest.param("\x1b[31mred", id="escape"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("\u202eevil", id="bidi"),
    pytest.param("../etc/passwd", id="path"),
    pytest.param("é", id="non-ascii"),
]


def zsync(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """``ztate *args`` as ``ztate`` in tests/integration/test_cli.py runs it, from a
    synchronous test (the context commands dial nothing)."""
    import subprocess

    done = subprocess.run(
        [str(ZTATE), *args], env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=60
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


async def thread_count(target: str, pki: Pki, env: dict[str, str]) -> int:
    code, out, err = await ztate(
        "threads",
        "list",
        "--limit",
        "100000",
        "-o",
        "json",
        *flags(target, pki.operator()),
        env=env,
    )
    assert code == 0, err
    return len(json.loads(out))


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(ZTATE_CONFIG=str(tmp_path / "config.yaml"), ZTATE_HOME=str(tmp_path))


@pytest.mark.parametrize("hostile", HOSTILE_IDS)
async def test_threads_create_and_show_refuse_what_is_not_a_thread_id(
    target: str, pki: Pki, env: dict[str, str], hostile: str
) -> None:
    if "\x00" in hostile:  # no process takes a NUL in its arguments
        hostile = hostile.replace("\x00", "\x01")
    before = await thread_count(target, pki, env)
    code, out, err = await ztate(
        "threads", "create", hostile, "--state", "{}", *flags(target, pki.operator()), env=env
    )
    assert (code, out) == (2, "")
    assert one_line(err) == f"ztate: REQUEST_INVALID: {THREAD_RULE}"
    code, out, err = await ztate(
        "threads", "show", hostile, *flags(target, pki.operator()), env=env
    )
    assert (code, out) == (2, "")
    assert one_line(err) == f"ztate: REQUEST_INVALID: {THREAD_RULE}"
    assert await thread_count(target, pki, env) == before


async def test_threads_hostile_states_policies_and_unknown_threads(
    target: str, pki: Pki, env: dict[str, str]
) -> None:
    connect = flags(target, pki.operator())
    before = await thread_count(target, pki, env)
    fresh = new_thread_id()
    for state, said in (
        ("[1]", "--state must be a JSON object"),
        (
            "{",
            "--state is not valid JSON: Expecting property name enclosed in double quotes "
            "(line 1, column 2)",
        ),
        # what the service would refuse, refused in one line (each was a traceback)
        ('{"raw_text": "\\ud800"}', "--state holds a lone surrogate"),
        ('{"a": ' * 200 + "1" + "}" * 200, "--state nests deeper than 128 levels"),
        (
            '{"a": ' + "9" * 5000 + "}",
            "--state holds an integer outside the I-JSON range +/-(2^53 - 1)",
        ),
        ('{"a": NaN}', "--state holds NaN, which is not a JSON number"),
        (
            "@/nonexistent/state.json",
            "--state @/nonexistent/state.json: cannot read (No such file or directory)",
        ),
    ):
        code, out, err = await ztate(
            "threads", "create", fresh, "--state", state, *connect, env=env
        )
        assert (code, out, one_line(err)) == (2, "", f"ztate: {said}"), state
    for policy in ("p" * 5000, "p" * 65, "a\nb", "\x1b[31m", "Upper", "-dash", "a."):
        for command in (("create", fresh, "--state", "{}"), ("list",)):
            code, out, err = await ztate(
                "threads", *command, f"--policy={policy}", *connect, env=env
            )
            assert (code, out) == (2, ""), (policy, command)
            assert err.splitlines()[-1] == (
                f"ztate threads {command[0]}: error: argument --policy: {POLICY_RULE}"
            )
            assert "Traceback" not in err
    code, out, err = await ztate(
        "threads", "create", fresh, "--state", "{}", "--policy", "no-such-policy", *connect, env=env
    )
    assert (code, out, one_line(err)) == (
        3,
        "",
        "ztate: POLICY_NOT_FOUND: no policy named 'no-such-policy' is loaded",
    )
    for limit in ("0", "-1", "100001", "x"):
        code, out, err = await ztate("threads", "list", "--limit", limit, *connect, env=env)
        assert (code, out) == (2, ""), limit
        assert "Traceback" not in err
    code, out, err = await ztate("threads", "show", fresh, *connect, env=env)
    assert (code, out) == (3, "")
    assert one_line(err) == f"ztate: THREAD_NOT_FOUND: thread {fresh!r} does not exist"
    assert await thread_count(target, pki, env) == before


CONTEXT_FILE = "contexts:\n  dev:\n    address: 127.0.0.1:7443\ncurrent-context: dev\n"


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("", id="empty"),
        pytest.param("n" * 129, id="one past the bound"),
        pytest.param("n" * 5000, id="long"),
        pytest.param("bad\nname", id="newline"),
        pytest.param("\x1b[31mred", id="escape"),
        pytest.param("-dash", id="flag-like"),
        pytest.param("a b", id="space"),
        pytest.param("\u202eevil", id="bidi"),
    ],
)
@pytest.mark.parametrize("command", ["use", "set", "delete"])
def test_context_commands_refuse_what_is_not_a_context_name(
    env: dict[str, str], command: str, name: str
) -> None:
    path = Path(env["ZTATE_CONFIG"])
    path.write_text(CONTEXT_FILE)
    code, out, err = zsync("context", command, "--", name, env=env)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == f"ztate context {command}: error: argument name: {NAME_RULE}"
    assert "Traceback" not in err
    assert path.read_text() == CONTEXT_FILE


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("n" * 5000, id="long"),
        pytest.param("\x1b]0;pwned\x07", id="escape"),
        pytest.param("a b", id="space"),
    ],
)
def test_a_chosen_context_that_is_not_a_name_is_refused_unechoed(
    env: dict[str, str], name: str
) -> None:
    """``--context`` and ``ZTATE_CONTEXT`` choose a context by name as ``context use``
    does: what is not a name is refused (exit 2, one line) and never printed back."""
    path = Path(env["ZTATE_CONFIG"])
    path.write_text(CONTEXT_FILE)
    code, out, err = zsync("context", "show", "--context", name, env=env)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == f"ztate context show: error: argument --context: {NAME_RULE}"
    code, out, err = zsync("context", "show", env=dict(env, ZTATE_CONTEXT=name))
    assert (code, out, one_line(err)) == (2, "", f"ztate: ZTATE_CONTEXT: {NAME_RULE}")
    assert path.read_text() == CONTEXT_FILE


def test_context_use_and_delete_of_an_unknown_context(env: dict[str, str]) -> None:
    path = Path(env["ZTATE_CONFIG"])
    path.write_text(CONTEXT_FILE)
    code, out, err = zsync("context", "use", "prod", env=env)
    assert (code, out, one_line(err)) == (
        2,
        "",
        f"ztate: no context 'prod' in {path} (known: dev)",
    )
    code, out, err = zsync("context", "delete", "prod", env=env)
    assert (code, out, one_line(err)) == (3, "", f"ztate: no context 'prod' in {path}")
    assert path.read_text() == CONTEXT_FILE


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--address", "a\nb:1", "--address: control characters are not allowed"),
        ("--address", "\x1b[31mx:1", "--address: control characters are not allowed"),
        ("--server-name", "x\x7f", "--server-name: control characters are not allowed"),
        ("--client-cert", "c\u009b.crt", "--cert: control characters are not allowed"),
        ("--address", "a" * 4097, "--address: more than 4096 characters"),
    ],
)
def test_context_set_refuses_hostile_settings(
    env: dict[str, str], flag: str, value: str, said: str
) -> None:
    path = Path(env["ZTATE_CONFIG"])
    path.write_text(CONTEXT_FILE)
    code, out, err = zsync("context", "set", "dev", flag, value, env=env)
    assert (code, out, one_line(err)) == (2, "", f"ztate: {said}")
    assert path.read_text() == CONTEXT_FILE
    code, out, err = zsync("context", "set", "fresh", flag, value, env=env)
    assert code == 2
    assert path.read_text() == CONTEXT_FILE


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"\xff\xfe\x00garbage", "the context file PATH is not UTF-8 text"),
        (b"a: [unclosed\n", "the context file PATH is not YAML: while parsing a flow sequence"),
        (b"- 1\n- 2\n", "the context file PATH must be a mapping"),
        (
            b"contexts: [1, 2]\n",
            "PATH: `contexts` must map names to settings; `current-context` a name",
        ),
        (
            b"current-context: 5\n",
            "PATH: `contexts` must map names to settings; `current-context` a name",
        ),
        (b'{"contexts": {"dev": {"address": 5}}}', "PATH: context 'dev': every value is a string"),
        (b'{"contexts": {"dev": "x"}}', "PATH: context 'dev' must be a mapping"),
        (
            b"contexts:\n  dev:\n    token: x\n",
            "PATH: context 'dev': unknown token "
            "(known: address, approval-address, cert, key, ca, server-name)",
        ),
        # hand-edited: what `context set` would refuse, refused without being echoed
        (
            b'{"contexts": {"dev": {"\\u001b[31mred": "x", "token": "y"}}}',
            "PATH: context 'dev': unknown 2 setting(s) "
            "(known: address, approval-address, cert, key, ca, server-name)",
        ),
        (
            b"contexts:\n  dev:\n    1: x\n",
            "PATH: context 'dev': unknown 1 setting(s) "
            "(known: address, approval-address, cert, key, ca, server-name)",
        ),
        (
            b'{"contexts": {"dev": {}, "\\u001b[31mred": {"address": "h:1"}}}',
            f"PATH: the name of context number 2 is not one ({NAME_TEXT})",
        ),
        (
            b'{"contexts": {"a b": {}}}',
            f"PATH: the name of context number 1 is not one ({NAME_TEXT})",
        ),
        (
            b'{"current-context": "\\u202eevil", "contexts": {}}',
            f"PATH: `current-context` is not a context name ({NAME_TEXT})",
        ),
        (
            b'{"contexts": {"dev": {"address": "\\u001b]0;pwned\\u0007h:1"}}}',
            "PATH: context 'dev': address: control characters are not allowed",
        ),
        (
            b'{"contexts": {"dev": {"cert": "' + b"c" * 4097 + b'"}}}',
            "PATH: context 'dev': cert: more than 4096 characters",
        ),
    ],
)
@pytest.mark.parametrize(
    "command",
    [("use", "dev"), ("set", "dev", "--address", "h:1"), ("delete", "dev"), ("list",)],
    ids=["use", "set", "delete", "list"],
)
def test_a_context_file_that_is_not_one_is_refused_and_kept(
    env: dict[str, str], content: bytes, said: str, command: tuple[str, ...]
) -> None:
    path = Path(env["ZTATE_CONFIG"])
    path.write_bytes(content)
    code, out, err = zsync("context", *command, env=env)
    assert (code, out) == (2, "")
    assert one_line(err) == "ztate: " + said.replace("PATH", str(path))
    assert path.read_bytes() == content


ESCAPE = ("\x1b]0;pwned\x07h:1", "control characters are not allowed")
NEWLINE = ("h:1\nztate: all is well", "control characters are not allowed")
LONG = ("h" * 5000, "more than 4096 characters")


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("ZTATE_ADDRESS", *ESCAPE),
        ("ZTATE_APPROVAL_ADDRESS", *NEWLINE),
        ("ZTATE_LISTEN", *LONG),
        ("ZTATE_APPROVAL_LISTEN", *ESCAPE),
        ("ZTATE_CERT", *NEWLINE),
        ("ZTATE_KEY", *LONG),
        ("ZTATE_CA", *ESCAPE),
        ("ZTATE_SERVER_NAME", *NEWLINE),
        ("ZTATE_HOME", *LONG),
        ("ZTATE_CONFIG", *ESCAPE),
        ("XDG_CONFIG_HOME", *NEWLINE),
    ],
)
def test_context_show_refuses_a_hostile_environment_unechoed(
    env: dict[str, str], variable: str, value: str, said: str
) -> None:
    """``context show`` prints what the environment gives: each value is held to what the
    context file may hold (no control characters, at most 4096 characters), else exit 2
    in one line naming the variable, the value never printed. (No context file: the
    listening addresses are read when nothing else gives an address.)"""
    if variable == "XDG_CONFIG_HOME":  # read only without ZTATE_CONFIG
        del env["ZTATE_CONFIG"]
    code, out, err = zsync("context", "show", env=dict(env, **{variable: value}))
    assert (code, out, err) == (2, "", f"ztate: {variable}: {said}\n")


@pytest.mark.parametrize(
    ("command", "flag", "value", "said"),
    [
        (("ledger", "list"), "--address", "\x1b[2Jh:1", "control characters are not allowed"),
        (("ledger", "list"), "--target", "h:1\nforged", "control characters are not allowed"),
        (("ledger", "list"), "--client-cert", "c" * 5000, "more than 4096 characters"),
        (("ledger", "list"), "--client-key", "k\u009b.key", "control characters are not allowed"),
        (("ledger", "list"), "--ca-cert", "ca\n.crt", "control characters are not allowed"),
        (("ledger", "list"), "--server-name", "x\x7f", "control characters are not allowed"),
        (("approvals", "list"), "--reviewer", "\x1b[31mbob", "control characters are not allowed"),
        (
            ("console", "--port", "0"),
            "--reviewer-cert",
            "r\n.crt",
            "control characters are not allowed",
        ),
        (("console", "--port", "0"), "--reviewer-key", "k" * 5000, "more than 4096 characters"),
        (
            ("console", "--port", "0"),
            "--approval-address",
            "\x1b[8mh:1",
            "control characters are not allowed",
        ),
    ],
)
def test_client_commands_refuse_hostile_connection_flags_unechoed(
    env: dict[str, str], command: tuple[str, ...], flag: str, value: str, said: str
) -> None:
    """The connection flags of every client command are held to the same rule before
    anything is read or dialled (an address or file is printed in errors): exit 2, one
    line naming the flag as given (``--target`` is ``--address``; the console's reviewer
    flags are its own), the value never printed."""
    code, out, err = zsync(*command, f"{flag}={value}", env=env)
    named = "--address" if flag == "--target" else flag
    assert (code, out, err) == (2, "", f"ztate: {named}: {said}\n")


def test_context_show_prints_settings_from_the_environment_as_given(
    env: dict[str, str],
) -> None:
    """What passes the rule is shown as given, whole line by line, with its source."""
    path = Path(env["ZTATE_CONFIG"])
    path.write_text(CONTEXT_FILE)
    given = dict(
        env,
        ZTATE_ADDRESS="h:1",
        ZTATE_CERT="c" * 4096,
        ZTATE_SERVER_NAME="ztate.example",
        ZTATE_APPROVAL_LISTEN="0.0.0.0:9444",
    )
    code, out, err = zsync("context", "show", env=given)
    assert (code, err) == (0, "")
    home = env["ZTATE_HOME"]
    lines = out.splitlines()
    assert lines[0] == f"context      dev  ({path})"
    assert lines[1:7] == [
        "transition",
        "  address      h:1   [ZTATE_ADDRESS]",
        f"  cert         {'c' * 4096}   [ZTATE_CERT]",
        f"  key          {home}/certs/operator-admin.key   [$ZTATE_HOME/certs ({home}/certs)]",
        f"  ca           {home}/certs/ca.crt   [$ZTATE_HOME/certs ({home}/certs)]",
        "  server_name  ztate.example   [ZTATE_SERVER_NAME]",
    ]
    assert lines[7:9] == ["approval", "  address      localhost:9444   [ZTATE_APPROVAL_LISTEN]"]


def test_saving_a_context_follows_no_planted_temporary_file(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The context file was written through a fixed temporary name beside it: in a shared
    folder, a link planted there made ``context set`` overwrite the link's target, and a
    world-writable file planted there left the context file world-writable. Now a new
    file of a random name, 0600, renamed over."""
    import stat

    path = Path(env["ZTATE_CONFIG"])
    path.write_text(CONTEXT_FILE)
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    planted = path.with_name(f".{path.name}.tmp")
    planted.symlink_to(victim)

    code, _out, err = zsync("context", "set", "dev", "--address", "db.example:7443", env=env)

    assert (code, err) == (0, ""), err
    assert victim.read_text() == "not yours"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "db.example:7443" in path.read_text()


@pytest.mark.parametrize(
    ("redirect", "said"),
    [(">/dev/full", "No space left on device"), (">&-", "standard output is closed")],
    ids=["full", "closed"],
)
@pytest.mark.parametrize("output", ["table", "json"])
def test_output_that_cannot_be_written_is_one_line_exit_1(
    env: dict[str, str], redirect: str, said: str, output: str
) -> None:
    """``ztate context list > /dev/full`` (or with stdout closed) gave a traceback. Now one
    line on stderr and exit 1; the context file is untouched."""
    import subprocess

    path = Path(env["ZTATE_CONFIG"])
    path.write_text(CONTEXT_FILE)
    done = subprocess.run(
        ["sh", "-c", f'exec "$0" "$@" {redirect}', str(ZTATE), "context", "list", "-o", output],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr.decode()) == (
        1,
        f"ztate: cannot write the output: {said}\n",
    )
    assert path.read_text() == CONTEXT_FILE


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--address", "x\u202ey:1"), ("--server-name", "a\u2028b"), ("--client-cert", "c\u200f.crt")],
    ids=["bidi override", "line separator", "right-to-left mark"],
)
def test_settings_refuse_format_characters_and_separators(
    env: dict[str, str], flag: str, value: str
) -> None:
    """``_setting`` refused C0 and C1 controls only: a bidi override or a line separator
    passed, and ``context show`` printed it raw."""
    path = Path(env["ZTATE_CONFIG"])
    path.write_text(CONTEXT_FILE)
    named = "--cert" if flag == "--client-cert" else flag
    said = f"ztate: {named}: unprintable characters (format characters, separators) are not allowed"
    code, out, err = zsync("context", "set", "dev", flag, value, env=env)
    assert (code, out, one_line(err)) == (2, "", said)
    assert path.read_text() == CONTEXT_FILE
    # hand-edited into the file: refused when read, by every command that reads it
    path.write_text(f'{{"contexts": {{"dev": {{"address": "{value}"}}}}}}')
    code, out, err = zsync("context", "show", "--context", "dev", env=env)
    assert (code, out, one_line(err)) == (
        2,
        "",
        f"ztate: {path}: context 'dev': address: unprintable characters (format characters, "
        "separators) are not allowed",
    )


def test_context_set_keeps_links_and_checks_what_it_stores(
    env: dict[str, str], tmp_path: Path
) -> None:
    """``context set`` stored the link's target: a link planted to a name holding an
    escape made every later command fail on the stored value, and a rotated secret
    (``tls.crt -> ..data/tls.crt``) was pinned to a folder the next rotation deletes."""
    path = Path(env["ZTATE_CONFIG"])
    secrets = tmp_path / "sec"
    (secrets / "..2026_v1").mkdir(parents=True)
    (secrets / "..data").symlink_to("..2026_v1")
    (secrets / "..2026_v1" / "tls.crt").write_text("pem")
    (secrets / "tls.crt").symlink_to("..data/tls.crt")
    evil = tmp_path / "evil.crt"
    evil.symlink_to(tmp_path / "x\x1b[31m.crt")
    code, _, err = zsync(
        "context", "set", "dev", "--client-cert", str(secrets / "tls.crt"), "--client-key",
        str(evil), "--ca-cert", "relative/ca.crt", env=env,
    )  # fmt: skip
    assert (code, err) == (0, "")
    stored = yaml_contexts(path)["dev"]
    assert stored["cert"] == str(secrets / "tls.crt")  # the link, not ..2026_v1
    assert stored["key"] == str(evil)
    assert stored["ca"] == str(Path.cwd() / "relative" / "ca.crt")
    code, out, err = zsync("context", "show", env=env)
    assert (code, err) == (0, "")
    assert f"  key          {tmp_path}/evil.crt   [context dev]" in out.splitlines()


def yaml_contexts(path: Path) -> dict[str, dict[str, str]]:
    import yaml

    found: dict[str, dict[str, str]] = yaml.safe_load(path.read_text())["contexts"]
    return found


def test_context_local_failures_are_one_line(env: dict[str, str], tmp_path: Path) -> None:
    """Each of these gave a traceback: an unknown user's ``~``, a context file deeply
    nested or endless (a link to /dev/zero), a context file in a folder that cannot be
    written."""
    path = Path(env["ZTATE_CONFIG"])
    path.write_text(CONTEXT_FILE)
    code, out, err = zsync(
        "context", "set", "dev", "--client-cert", "~nosuchuser-ztate/x.crt", env=env
    )
    assert (code, out, one_line(err)) == (
        2,
        "",
        "ztate: --cert: cannot expand ~USER: no such user",
    )
    assert path.read_text() == CONTEXT_FILE

    deep = tmp_path / "deep.yaml"
    deep.write_text("contexts: " + "[" * 5000 + "]" * 5000 + "\n")
    for command in (("context", "list"), ("ledger", "list")):
        code, out, err = zsync(*command, env=dict(env, ZTATE_CONFIG=str(deep)))
        assert (code, out, one_line(err)) == (
            2,
            "",
            f"ztate: the context file {deep} nests too deeply",
        )
    code, out, err = zsync("context", "list", env=dict(env, ZTATE_CONFIG="/dev/zero"))
    assert (code, out, one_line(err)) == (
        2,
        "",
        "ztate: the context file /dev/zero holds more than 1,048,576 bytes",
    )
    nowhere = Path("/proc/ztate-test/config.yaml")  # no folder can be made there
    code, out, err = zsync(
        "context", "set", "dev", "--address", "h:1", env=dict(env, ZTATE_CONFIG=str(nowhere))
    )
    assert (code, out, one_line(err)) == (
        2,
        "",
        f"ztate: cannot write the context file {nowhere}: No such file or directory",
    )
    assert not nowhere.parent.exists()
