"""ztate.services.policy.credentials: every kind found where it sits, benign text left alone, fast.

Fake credentials are assembled at run time from pieces (``_join``) so that no secret
scanner flags this file; the entropy cases use fresh ``secrets`` output every run.
The property tests also check that the whole-value prefilter never hides what the
string-by-string walk would find, JSON escaping included.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import random
import re
import statistics
import time
import uuid
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ztate.services.policy import credentials
from ztate.services.policy.credentials import CredentialFinding, find_credential

# Fixed-seed stand-ins for the secrets module: random-looking keys, the same every
# run, so a rare entropy miss can never make the suite flaky.
RNG = random.Random(8785)


def token_bytes(n: int) -> bytes:
    return RNG.randbytes(n)


def token_hex(n: int) -> str:
    return RNG.randbytes(n).hex()


def token_urlsafe(n: int) -> str:
    return base64.urlsafe_b64encode(RNG.randbytes(n)).rstrip(b"=").decode()


PROPERTY = settings(max_examples=300, deadline=None)


def _join(*parts: str) -> str:
    return "".join(parts)


def _fake(length: int, pattern: str = "FAKE0fake1FAKE2fake3") -> str:
    """An obviously fake token body of ``length`` characters."""
    return (pattern * (length // len(pattern) + 1))[:length]


def _b64url(data: dict[str, object]) -> str:
    raw = json.dumps(data, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _jwt() -> str:
    header = _b64url({"alg": "HS256", "typ": "JWT"})
    payload = _b64url({"sub": "fake-user-1234", "name": "Test User", "iat": 1516239022})
    return _join(header, ".", payload, ".", _fake(43))


FORMATS: list[tuple[str, str]] = [
    ("PEM private key", _join("-----BEGIN RSA ", "PRIVATE KEY-----\n", _fake(64), "\n-----END")),
    ("PEM private key", _join("-----BEGIN ", "PRIVATE KEY-----")),
    ("PEM private key", _join("-----BEGIN EC ", "PRIVATE KEY-----")),
    ("PEM private key", _join("-----BEGIN ENCRYPTED ", "PRIVATE KEY-----")),
    ("PEM private key", _join("---- BEGIN SSH2 ENCRYPTED ", "PRIVATE KEY ----")),
    ("OpenSSH private key", _join("-----BEGIN OPENSSH ", "PRIVATE KEY-----\nb3BlbnNzaC1r")),
    ("PGP private key block", _join("-----BEGIN PGP ", "PRIVATE KEY BLOCK-----")),
    ("PuTTY private key", _join("PuTTY-User-", "Key-File-2: ssh-rsa")),
    ("AWS access key id", _join("AKIA", "IOSFODNN7EXAMPLE")),
    ("AWS access key id", _join("export AWS_ACCESS_KEY_ID=ASIA", "FAKEFAKEFAKE2345")),
    ("AWS secret access key", _join("aws_secret_access_key = ", _fake(40, "FAKE0fake1/+"))),
    ("GitHub token", _join("ghp", "_", _fake(36))),
    ("GitHub token", _join("gho", "_", _fake(36))),
    ("GitHub token", _join("ghu", "_", _fake(36))),
    ("GitHub token", _join("ghs", "_", _fake(36))),
    ("GitHub token", _join("ghr", "_", _fake(36))),
    ("GitHub token", _join("github", "_pat_", _fake(22), "_", _fake(59))),
    ("GitLab token", _join("glpat", "-", _fake(20))),
    ("Slack token", _join("xoxb", "-123456789012-1234567890123-", _fake(24))),
    ("Slack token", _join("xoxp", "-123456789012-1234567890123-1234567890123-", _fake(32))),
    ("Slack token", _join("xapp", "-1-A0FAKEFAKE-1234567890123-", _fake(32))),
    (
        "Slack webhook URL",
        _join("https://hooks.", "slack.com/services/", "T00000000/B00000000/", _fake(24)),
    ),
    ("Stripe API key", _join("sk", "_live_", _fake(24))),
    ("Stripe API key", _join("rk", "_live_", _fake(24))),
    ("Google API key", _join("AI", "za", _fake(35))),
    ("OpenAI-style API key", _join("sk", "-", _fake(48))),
    ("OpenAI-style API key", _join("sk", "-proj-", _fake(64))),
    ("Anthropic API key", _join("sk", "-ant-api03-", _fake(93), "AA")),
    ("npm token", _join("npm", "_", _fake(36))),
    ("PyPI token", _join("pypi", "-AgEIcHlwaS5vcmc", _fake(60))),
    ("Hugging Face token", _join("hf", "_", _fake(34, "FakeFakeToken"))),
    ("JSON Web Token", _jwt()),
    ("bearer token", _join("Authorization: Bearer ", _fake(32))),
    ("bearer token", _join("authorization: bearer\t", _fake(16))),  # \t once escaped
    ("HTTP Basic credential", _join("basic\t", "dTpwYXNzd29yZDEy")),
    ("HTTP Basic credential", _join("Authorization: Basic ", "YWxpY2U6Y29ycmVjdCBob3JzZQ==")),
    (
        "URL with embedded password",
        _join("postgres://app:", "Tr0ub4dor&3", "@db.internal:5432/app"),
    ),
    ("URL with embedded password", _join("redis://:", "s3cr3t-pass", "@cache:6379/0")),
    ("URL with embedded password", _join("https://alice:", "hunter2", "@example.com/")),
    # secrets in the shapes of placeholders: a $, braces, angle or square brackets
    ("URL with embedded password", _join("postgres://app:", "$upErS3cretPw9", "@db:5432/a")),
    ("URL with embedded password", _join("postgres://app:", "{kT9vQ2!mZ}", "@db:5432/a")),
    ("URL with embedded password", _join("postgres://app:", "<kT9vQ2!mZ>", "@db/a")),
    ("URL with embedded password", _join("redis://:", "[kT9vQ2!mZ-77]", "@cache:6379")),
]
FORMAT_IDS = [f"{kind}-{i}" for i, (kind, _) in enumerate(FORMATS)]
KINDS = sorted({kind for kind, _ in FORMATS})

# Fresh random keys every run: each must be flagged (the threshold leaves >= 5 spreads
# of margin for these lengths; see the module docstring).
RANDOM_KEYS: dict[str, tuple[str, Callable[[], str]]] = {
    "token_hex(20)": ("high-entropy hex string", lambda: token_hex(20)),
    "token_hex(32)": ("high-entropy hex string", lambda: token_hex(32)),
    "0x + token_hex(32)": ("high-entropy hex string", lambda: "0x" + token_hex(32)),
    "upper token_hex(32)": ("high-entropy hex string", lambda: token_hex(32).upper()),
    "sha256 hexdigest": (
        "high-entropy hex string",
        lambda: hashlib.sha256(token_bytes(8)).hexdigest(),
    ),
    "token_urlsafe(32)": ("high-entropy string", lambda: token_urlsafe(32)),
    "token_urlsafe(48)": ("high-entropy string", lambda: token_urlsafe(48)),
    "b64encode(32 bytes)": (
        "high-entropy string",
        lambda: base64.b64encode(token_bytes(32)).decode(),
    ),
    "b64encode(64 bytes)": (
        "high-entropy string",
        lambda: base64.b64encode(token_bytes(64)).decode(),
    ),
}

BENIGN = [
    "hello world",
    "The customer asked for a refund on order 42; we approved it.",
    "Please review the attached invoice before Friday, thanks!",
    "Le client a demandé un remboursement pour la commande n° 42.",
    "Die Bestellung wurde gestern verschickt; Lieferung voraussichtlich Montag.",
    "¿Podría confirmar la dirección de envío, por favor?",
    "注文は昨日発送されました。明日到着予定です。",
    "客户要求退款，我们已经批准。",  # noqa: RUF001
    "Клиент запросил возврат средств за заказ номер 42.",
    "تم شحن الطلب أمس وسيصل غدًا.",
    "ग्राहक ने धनवापसी का अनुरोध किया है।",
    "Η παραγγελία στάλθηκε χθες.",  # noqa: RUF001
    "Shipped! 🚚📦 ETA tomorrow 🎉",
    "## Summary\n\nThe **deployment** succeeded. See [the runbook](https://example.com/runbooks/"
    "deploy) and run `make test` before merging.\n\n- first item\n- second item\n",
    "550e8400-e29b-41d4-a716-446655440000",
    "F47AC10B-58CC-4372-A567-0E02B2C3D479",
    "urn:uuid:6ba7b810-9dad-11d1-80b4-00c04fd430c8",
    "2024-05-01T12:34:56.789Z",
    "2024-05-01T12:34:56+02:00",
    "Wed, 21 Oct 2015 07:28:00 GMT",
    "2024-05-01 12:34:56,789 INFO ztate.transition_service.pipeline accepted patch version=12",
    "https://example.com/",
    "https://docs.python.org/3/library/secrets.html#module-secrets",
    "https://stackoverflow.com/questions/375427/non-blocking-read-on-a-subprocess-pipe-in-python",
    "https://github.com/python/cpython/issues/12345",
    "https://example.com/search?q=hello+world&page=2&sort=desc",
    "https://alice@example.com/profile",
    "postgres://app:***@db.internal:5432/app",
    "redis://:${REDIS_PASSWORD}@cache:6379/0",
    "redis://:$REDIS_PASSWORD@cache:6379/0",
    "https://user:<password>@example.com/",
    "https://user:<your-password>@example.com/",
    "postgres://app:{password}@db:5432/app",
    "postgres://app:{{ .Password }}@db:5432/app",
    "postgres://app:[pass]@db:5432/app",
    "ftp://ftp.example.org/pub/linux/kernel/v6.x/",
    "/home/alice/projects/ztate/services/credentials.py",
    "/usr/lib/python3.11/site-packages/pydantic/main.py",
    "/var/log/nginx/access.log.2024-05-01.gz",
    "C:\\Users\\alice\\Documents\\Quarterly Report 2024.xlsx",
    "../../src/components/UserProfileSettingsPanel.tsx",
    "alice.smith+orders@example.co.uk",
    "support@example.com",
    "aGVsbG8=",
    "enRhdGU=",
    base64.b64encode(b"see you at noon").decode(),
    "refund_order_42",
    "getUserAccountBalanceForPeriod",
    "MAX_RETRY_ATTEMPTS_BEFORE_GIVING_UP",
    "customer-support-escalation-queue",
    "com.example.orders.RefundService",
    "test_refund_is_idempotent_under_concurrent_retries",
    "how-to-configure-mutual-tls-between-agents-and-the-control-plane",
    "AbstractSingletonProxyFactoryBeanImplementation",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789",
    "----------------------------------------------------------------",
    "3.141592653589793",
    "12345678901234567890123456789012345678901234567890",
    "+1 (555) 010-9999",
    "ztate 0.1.0 (grpcio 1.85.1, protobuf 6.31.0), commit 8e6848d",
    "The bearer of this letter is a friend of mine.",
    "Basic arithmetic is taught before algebra.",
    "Bearer tokens are described in RFC 6750; Basic authentication in RFC 7617.",
    "We trained the model with scikit-learn (sk-learn) 1.5 last week.",
    "Set the password in the DATABASE_PASSWORD environment variable.",
    'The API returned {"status": "ok", "count": 3} after 120 ms.',
    "Use `aws configure` to set your access key id and secret access key.",
]

_WORD_LIST = (
    "the a an of to and in is it that for on with as was be by this are or at from "
    "customer order refund shipping invoice address weather tomorrow morning support team "
    "agent summary notes escalate priority resolved pending review approve deny update "
    "basic bearer token secret password key private public access aws github slack stripe "
    "organization configuration authentication authorization internationalization "
    "responsibilities understanding documentation troubleshooting collaboration "
    "Monday Friday January London Paris API HTTP JSON URL ID OK"
)
WORDS = _WORD_LIST.split()


_PLAIN_TEXT = (
    "the customer asked about a refund for order shipping was delayed because the warehouse "
    "closed during bad weather please confirm the address and we will follow up tomorrow "
    "morning with a tracking number invoice attached thanks regards support team"
)
PLAIN_WORDS = _PLAIN_TEXT.split()


def _prose(size: int) -> dict[str, str]:
    """A JSON object of about ``size`` bytes of ordinary sentences, the same every run."""
    obj: dict[str, str] = {}
    index = 0
    while len(json.dumps(obj)) < size:
        words = [PLAIN_WORDS[(index * 7 + i * 13) % len(PLAIN_WORDS)] for i in range(8 + index % 9)]
        obj[f"note_{index}"] = " ".join(words).capitalize() + "."
        index += 1
    return obj


# --- well-known formats --------------------------------------------------------------


@pytest.mark.parametrize(("kind", "value"), FORMATS, ids=FORMAT_IDS)
def test_format_found_in_a_plain_string(kind: str, value: str) -> None:
    assert find_credential(value) == CredentialFinding(kind, "")


@pytest.mark.parametrize(("kind", "value"), FORMATS, ids=FORMAT_IDS)
def test_format_found_inside_text(kind: str, value: str) -> None:
    assert find_credential(f"config follows:\n{value}\n(do not share)") == CredentialFinding(
        kind, ""
    )


@pytest.mark.parametrize(("kind", "value"), FORMATS, ids=FORMAT_IDS)
def test_formats_apply_without_the_entropy_heuristic(kind: str, value: str) -> None:
    nested = {"config": {"items": ["fine", {"token": value}]}}
    assert find_credential(nested, high_entropy=False) == CredentialFinding(
        kind, "/config/items/1/token"
    )


@pytest.mark.parametrize(("kind", "value"), FORMATS, ids=FORMAT_IDS)
def test_format_found_in_a_member_name(kind: str, value: str) -> None:
    nested = {"outer": [{"ok": 1}, {value: "harmless"}]}
    assert find_credential(nested) == CredentialFinding(f"{kind} in a member name", "/outer/1")


@pytest.mark.parametrize(("kind", "value"), FORMATS, ids=FORMAT_IDS)
def test_finding_never_holds_the_secret(kind: str, value: str) -> None:
    finding = find_credential({"a": value})
    assert finding is not None
    shown = repr(finding)
    assert value not in shown
    body = max(re.findall(r"[A-Za-z0-9]+", value), key=len)  # the secret part, mostly
    assert len(body) < 8 or body not in shown


def test_every_format_kind_is_exercised() -> None:
    assert set(KINDS) == {
        "PEM private key",
        "OpenSSH private key",
        "PGP private key block",
        "PuTTY private key",
        "AWS access key id",
        "AWS secret access key",
        "GitHub token",
        "GitLab token",
        "Slack token",
        "Slack webhook URL",
        "Stripe API key",
        "Google API key",
        "npm token",
        "PyPI token",
        "Hugging Face token",
        "OpenAI-style API key",
        "Anthropic API key",
        "JSON Web Token",
        "bearer token",
        "HTTP Basic credential",
        "URL with embedded password",
    }


def test_aws_secret_named_by_its_member() -> None:
    value = {"credentials": {"aws_secret_access_key": _fake(40, "FAKE0fake1/+")}}
    expected = CredentialFinding("AWS secret access key", "/credentials/aws_secret_access_key")
    assert find_credential(value) == expected
    assert find_credential(value, high_entropy=False) == expected


@pytest.mark.parametrize(
    "value",
    [
        _join("AKIA", "IOSFODNN7EXAMPLEX"),  # 21 characters: not a key id
        _join("xAKIA", "IOSFODNN7EXAMPLE"),  # part of a longer word
        _join("task", "-", _fake(40)),  # "sk-" inside a word
        _join("sk", "-", "learn-is-a-python-library-for-machine-learning"),
        _join("Bearer ", "YOUR_ACCESS_TOKEN_HERE"),
        _join("Basic ", "understanding"),
        _join("eyJ", "hello", ".", "eyJ", "world", "."),  # too short for a JWT
        _join("eyJub3RfYV9oZWFkZXIiOjF9", ".", "eyJzdWIiOiJ4eXoifQ", "."),  # no "alg"/"typ"
        _join("sk", "_live_", "short"),
    ],
)
def test_near_misses_are_not_formats(value: str) -> None:
    assert find_credential(value, high_entropy=False) is None


# --- paths and order -------------------------------------------------------------------


def test_path_escapes_member_names_as_a_json_pointer() -> None:
    value = {"a/b": {"c~d": [0, 1, _join("ghp", "_", _fake(36))]}}
    assert find_credential(value) == CredentialFinding("GitHub token", "/a~1b/c~0d/2")


def test_first_finding_in_document_order() -> None:
    value = {
        "a": "fine",
        "b": [_join("AKIA", "IOSFODNN7EXAMPLE")],
        "c": _join("ghp", "_", _fake(36)),
    }
    assert find_credential(value) == CredentialFinding("AWS access key id", "/b/0")


def test_member_names_of_an_object_before_its_values() -> None:
    value = {"first": _join("ghp", "_", _fake(36)), _join("AKIA", "IOSFODNN7EXAMPLE"): 1}
    assert find_credential(value) == CredentialFinding("AWS access key id in a member name", "")


@pytest.mark.parametrize("value", [None, True, 0, 1.5, "", [], {}, [None, [], {"": {}}]])
def test_values_without_strings(value: object) -> None:
    assert find_credential(value) is None


def test_values_orjson_refuses_are_still_scanned() -> None:
    secret = _join("AKIA", "IOSFODNN7EXAMPLE")
    assert find_credential({"x": f"\ud800 {secret}"}) == CredentialFinding(
        "AWS access key id", "/x"
    )
    assert find_credential({1: ("fine", secret)}) == CredentialFinding("AWS access key id", "/1/1")
    assert find_credential({"big": 2**70, "s": secret}) == CredentialFinding(
        "AWS access key id", "/s"
    )


# --- high entropy --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RANDOM_KEYS))
def test_random_keys_are_high_entropy(name: str) -> None:
    kind, make = RANDOM_KEYS[name]
    for _ in range(10):
        key = make()
        assert find_credential({"deep": [{"k": key}]}) == CredentialFinding(kind, "/deep/0/k")
        assert find_credential(f"the key is {key}, keep it safe") == CredentialFinding(kind, "")


@pytest.mark.parametrize("name", sorted(RANDOM_KEYS))
def test_high_entropy_off_stops_only_the_heuristic(name: str) -> None:
    _, make = RANDOM_KEYS[name]
    key = make()
    assert find_credential({"digest": key}, high_entropy=False) is None
    aws = _join("AKIA", "IOSFODNN7EXAMPLE")
    assert find_credential({"digest": key, "id": aws}, high_entropy=False) == CredentialFinding(
        "AWS access key id", "/id"
    )


def test_high_entropy_member_name() -> None:
    key = token_hex(32)
    assert find_credential({"by_digest": {key: "x"}}) == CredentialFinding(
        "high-entropy hex string in a member name", "/by_digest"
    )
    assert find_credential({"by_digest": {key: "x"}}, high_entropy=False) is None


def test_random_key_never_in_finding() -> None:
    key = token_urlsafe(32)
    finding = find_credential({"k": key})
    assert finding is not None
    assert key not in repr(finding)


# --- benign text -----------------------------------------------------------------------


@pytest.mark.parametrize("text", BENIGN)
def test_benign_strings_are_never_flagged(text: str) -> None:
    assert find_credential(text) is None
    assert find_credential({text: [text, {"nested": text}]}) is None


def test_benign_corpus_is_large_and_varied() -> None:
    assert len(BENIGN) >= 40
    assert any(not text.isascii() for text in BENIGN)


def test_random_uuids_are_not_flagged() -> None:
    ids = [str(uuid.uuid4()) for _ in range(50)]
    assert find_credential({"ids": ids, "joined": " ".join(ids)}) is None


@PROPERTY
@given(st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=40), max_size=8))
def test_dictionary_prose_is_never_flagged(paragraphs: list[list[str]]) -> None:
    texts = [" ".join(words) for words in paragraphs]
    assert find_credential({"notes": texts}) is None
    assert all(find_credential(text) is None for text in texts)


# --- the prefilter never hides a finding -----------------------------------------------

FRAGMENTS = [
    " ",
    "\t",
    "\n",
    '"',
    "\\",
    "\u2028",
    "é",
    "€",
    ":",
    "@",
    "/",
    "//",
    "://",
    ".",
    "=",
    "-",
    "_",
    "Bearer",
    "bearer",
    "BASIC",
    "basic",
    "aws",
    "secret",
    "=",
    "-----BEGIN ",
    "PRIVATE KEY",
    "AKIA",
    "FAKEFAKEFAKE2345",
    "eyJhbGciOiJIUzI1NiJ9",
    "eyJzdWIiOiJmYWtlLXVzZXIifQ",
    "YWxpY2U6cHc=",
    "user",
    "pa55word",
    "host",
    "ghp_",
    "sk-",
    "FAKE0fake1FAKE2fake3",
    "FAKE0fake1FAKE2f",
    "0123abcd",
]
TEXTS = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    st.sampled_from([value for _, value in FORMATS] + BENIGN),
    st.text(max_size=30),
)
VALUES = st.recursive(
    st.one_of(TEXTS, st.integers(-(2**53), 2**53), st.none(), st.booleans()),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(TEXTS, children, max_size=4)
    ),
    max_leaves=12,
)


@PROPERTY
@given(VALUES, st.booleans())
def test_prefilter_never_hides_what_the_walk_finds(value: object, high_entropy: bool) -> None:
    # The walk alone is the reference: find_credential adds only the whole-value prefilter.
    expected = credentials._walk(value, high_entropy)
    assert find_credential(value, high_entropy=high_entropy) == expected


@PROPERTY
@given(st.sampled_from(FORMATS), st.lists(st.sampled_from(FRAGMENTS), max_size=6), st.booleans())
def test_formats_survive_json_escaping_neighbours(
    case: tuple[str, str], around: list[str], high_entropy: bool
) -> None:
    _, value = case
    text = f"{''.join(around)} {value}\n"
    finding = find_credential({"k": text}, high_entropy=high_entropy)
    assert finding is not None
    assert finding.path == "/k"


# --- cost ----------------------------------------------------------------------------


def test_one_kilobyte_of_prose_is_cheap() -> None:
    value = _prose(1000)
    assert 900 <= len(json.dumps(value)) <= 1300
    assert find_credential(value) is None
    timings = []
    for _ in range(200):
        start = time.perf_counter_ns()
        find_credential(value)
        timings.append(time.perf_counter_ns() - start)
    assert statistics.median(timings) < 200_000  # ns; about 3 us on the reference machine


@pytest.mark.parametrize(
    "text",
    [
        "sk-" * 7000,
        "ghp_" * 5000,
        "sk-" + "a-" * 10000,
        "://:" + "a" * 20000,
        ("aws" + "_" * 20 + "secret" + "_" * 20 + "=") * 400,
        ("eyJ" + "a" * 17 + ".") * 1000,
        "-----BEGIN " + "A" * 20000,
        "bearer " + "ab" * 10000,
        "aZ09" * 5000,
    ],
    ids=["sk", "ghp", "sk-run", "url", "aws", "jwt", "pem", "bearer", "base64"],
)
def test_pathological_strings_scan_in_linear_time(text: str) -> None:
    # ~20 KB each: about 3 ms when linear, far over the bound if a pattern backtracks
    # quadratically (the "sk-" case once took 56 ms at 9 KB).
    timings = []
    for _ in range(3):
        start = time.perf_counter_ns()
        find_credential({"v": text})
        timings.append(time.perf_counter_ns() - start)
    assert min(timings) < 100_000_000


@pytest.mark.parametrize("compiled", [True, False], ids=["in-C", "pure-Python"])
def test_verdicts_equal_those_of_the_scan_before_its_rewrite(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4,000 generated strings (fixed seed), each scanned with and without the entropy
    rule, give the verdicts the scan gave before its statistics moved to C: frozen in
    tests/vectors/credentials/verdicts.json by the old code (see its generate.py).
    Both the compiled statistics and the pure Python fallback give them."""
    from tests.vectors.credentials import generate

    if compiled and credentials._textstats is None:
        pytest.fail("services/policy/_textstats.c is not built: make test-unit reinstalls it")
    if not compiled:
        monkeypatch.setattr(credentials, "_textstats", None)
    frozen = json.loads(generate.VERDICTS.read_text())
    assert len(frozen) == generate.COUNT
    assert sum(1 for row in frozen if row[0] is not None) > 1_000  # the entropy rule fires
    assert generate.verdicts() == frozen


def test_literals_found_in_one_pass() -> None:
    """_textstats.found: every needle wherever it sits (first byte, last byte, one
    byte long, overlapping another), none that does not occur, at most 64."""
    textstats = credentials._textstats
    if textstats is None:
        pytest.fail("services/policy/_textstats.c is not built: make test-unit reinstalls it")
    needles = (b"ab", b"b", b"xyz", b"yz", b"q", b"abc", b"zz")
    assert textstats.found(b"abxyz", needles) == 0b0001111
    assert textstats.found(b"", needles) == 0
    assert textstats.found(b"zz", needles) == 0b1000000
    assert textstats.found(b"q", needles) == 0b0010000
    assert len(credentials._NEEDLES) <= 64
    assert len(credentials._LOWERED_NEEDLES) <= 64
    with pytest.raises(ValueError, match="at most 64"):
        textstats.found(b"a", (b"a",) * 65)


@pytest.mark.parametrize("compiled", [True, False], ids=["in-C", "pure-Python"])
def test_word_and_entropy_statistics_equal_their_definitions(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C-speed statistics give the same floats as their definitions (``_WORD``
    matches, ``Counter``), on short and long runs (the long ones take the grouped
    count), over the characters whose classes decide word starts."""
    import math
    from collections import Counter

    if not compiled:
        monkeypatch.setattr(credentials, "_textstats", None)
    rng = random.Random(19)
    for number in range(3_000):
        chars = (
            "aAbB09zZ_-+/" if number % 2 else "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789+/_-"
        )
        text = "".join(rng.choice(chars) for _ in range(rng.choice((1, 7, 40, 300, 2_000))))
        rest, words = credentials._WORD.subn("", text)
        assert credentials._mean_word_length(text) == (
            (len(text) - len(rest)) / words if words else math.inf
        ), text
        n = len(text)
        expected = math.log2(n) - sum(c * math.log2(c) for c in Counter(text).values()) / n
        assert credentials._entropy(text) == expected, text
        steps = sum(1 for a, b in itertools.pairwise(text) if ord(b) - ord(a) == 1)
        assert credentials._sequential(text) == (len(text) < 2 or 2 * steps >= len(text) - 1)
