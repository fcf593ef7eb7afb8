"""Refuse credential-looking strings in state values: secrets never enter state.

Every proposal passes through here, so the common case (a value holding no secret)
must cost microseconds. detect-secrets took about 700 us per short line and flagged
plain prose. The scan has two stages:

1. **Prefilter, on the whole value at once.** orjson serialises the value, and one
   ``bytes.translate`` maps each token character ``[A-Za-z0-9+/_-]`` to ``a`` and
   every other byte to a space. Every rule below needs at least one of: a run of
   20 token characters, ``PRIVATE KEY``, ``://...@``, or ``bearer``/``basic``
   followed by whitespace and a run of 16. A few substring searches settle that,
   and ordinary prose has none of these. JSON escaping only turns a character into a
   backslash sequence, so it cannot hide a match from this stage. It can only raise
   false alarms, and stage 2 settles those.
2. **Walk, only if stage 1 fired.** Each string, member names included, goes
   through the same prefilter and then the rules that its literal (``AIza``,
   ``sk-``, ...) admits. Regular expressions run only on the strings that need them.

Costs on the reference machine (Python 3.11): ``re`` scans a character class at
about 7 ns a byte, and ``bytes.translate`` costs about 1 ns. ``in`` on ``bytes`` has
a fixed cost of about 130 ns, six times that of ``str``, so skeletons are decoded
to ``str``. Measured with ``timeit`` (best of 9, machine shared with other work):
1 KB of prose strings takes 2.2 us and 10 KB takes 16 us. A value that sends stage
1 to the walk (a URL with a long path, a file path, a digest) costs about 1 us per
string in it, plus a few us for each string that fires. 1 KB of prose with one such
URL takes 19 us, and 10 KB takes 110 us.

A long random run goes all the way to the entropy rule, and a long token string
holds many of the literals. Their statistics run in C (``_textstats.c``, built into
the wheel; the pure Python here is its reference and the fallback where nothing
compiled it): one pass finds which literals (or the prefixes a pattern spells out)
occur, so a rule's regular expression runs only where one does; one pass counts the
characters, one the words, one the consecutive steps. A 10 KB random token took 1.2
ms of CPU before and takes about 70 us now; 10 KB of base64url under an opaque key
115 us before and 30 now (docs/performance.md has the table). tests/vectors/credentials
freezes the verdicts of the code before this rewrite over 4,000 generated strings;
both the C and the Python path give them.

**Well-known formats** always apply. They are adapted from detect-secrets 1.5
(``detect_secrets/plugins/*.py``) and gitleaks (``config/gitleaks.toml``):

* PEM, OpenSSH, PGP, SSH2 and PuTTY private key headers.
* AWS access key ids (``AKIA``/``ASIA``/``ABIA``/``ACCA``/``A3T`` and 16 base32
  characters). Also a 40-character secret access key assigned after
  ``aws ... secret`` in the text, or held by a member named like
  ``aws_secret_access_key``.
* GitHub (``ghp_``, ``gho_``, ``ghu_``, ``ghs_``, ``ghr_``, ``github_pat_``) and
  GitLab (``glpat-`` and its siblings) tokens.
* Slack tokens (``xox?-``, ``xapp-``) and ``hooks.slack.com`` webhooks.
* Stripe (``sk_``/``rk_`` with ``live``/``test``/``prod``), Google (``AIza`` + 35),
  npm, PyPI and Hugging Face tokens.
* ``sk-`` keys (OpenAI style, and Anthropic's ``sk-ant-``): at least 32 characters
  after the prefix, with a digit, and not a hyphenated phrase.
* JSON Web Tokens: two ``eyJ`` segments and a third, with a header that decodes
  to text holding ``"alg"`` or ``"typ"``.
* ``Bearer <token>`` with a random-looking token of at least 16 characters, and
  ``Basic <base64>`` that decodes to ``user:password``.
* URLs with a password in the userinfo, unless the password is a placeholder
  (``***``, ``${VAR}``, ``<password>``, ``password``, ...).

**High-entropy strings** are the only rule ``high_entropy=False`` turns off.
Candidates are maximal runs of ``[A-Za-z0-9+/_-]`` of at least 32 characters.
A run that mixes the standard (``+/``) and URL-safe (``_-``) base64 alphabets is
split, since no single encoding produces both. Runs of at least 40 hex digits
(after an optional ``0x``; a UUID has at most 12 between dashes) are judged as hex.

A run is flagged when its Shannon entropy per character ``H`` is at least
``E(n, k) - 0.85``. ``E(n, k) = log2(k) - (k - 1) / (2 n ln 2)`` is the
Miller-Madow expected entropy of ``n`` uniform draws from ``k`` symbols, where
``k`` is 16 for hex, 36 for single-case letters and digits, and 64 otherwise.
The threshold comes to 2.88 for 40 hex digits, 2.98 for 64, 3.73 for 32 base64
characters and 4.08 for 44.

A fixed threshold cannot work, because entropy grows with length. detect-secrets'
4.5 misses half of all random 32-character tokens (their median is 4.56). A
threshold of 4.0 flags 29% of the 34,150 distinct long tokens found in Python
sources, package metadata and ``/usr/share/doc``. Structure is what tells random
tokens from identifiers, slugs and paths. Count as words the ``[A-Z]?[a-z]+``
runs, upper-case runs and digit runs: they average 1.8 characters in random
tokens and 5.7 in those benign ones. So:

* runs whose words average 4.5 or more are never flagged;
* runs whose words average 3.5 to 4.5 need the tighter margin of 0.45;
* a single-case run needs a digit;
* runs of consecutive characters (``ABCDEF...``) are never flagged.

Data behind the numbers (random from ``secrets``):

* ``H - E`` over 300,000 draws has a minimum of -0.73 for ``token_urlsafe(32)``,
  -0.70 for base64 of 32 bytes, -0.82 for ``token_urlsafe(24)``, -0.70 for
  ``token_hex(20)`` and -0.46 for ``token_hex(32)``. With a spread of about 0.16,
  the 0.85 margin is five spreads out.
* Misses: none in 50,000 for hex keys or ``token_urlsafe(32)``. About 4 per
  million for base64 of 32 bytes, whose letters happened to fall in long
  same-case runs. Up to 4 in 50,000 for 24-byte tokens and 32-character
  alphanumerics, and about 90 in 50,000 for 32-character base32.
* False alarms. Of 4,033 URLs, 17: 12 hex (commit links) and 5 with random ids or
  an example secret in the path. Of 71,766 lines of package metadata and
  copyright files, 30: 15 hex digests, 14 file names such as
  ``ontop_i386_x86_64_sysv_macho_gas``, and one ``cvs://:pserver:anoncvs@`` URL.

Trade-offs. These are all flagged, because they cannot be told apart from keys:
hex digests (a SHA-256, a git commit, also inside a link), base64 of more than
about 24 bytes (prose, images, ``data:`` URIs, ciphertext), random ids of 32 or
more characters (cloud document ids), and long upper-case constants with digits
(``TLS_DHE_RSA_WITH_AES_256_GCM_SHA384``). Opaque keys (``high_entropy=False``)
exist for such values. Secrets under 32 characters in no known format pass, and
so does anything split or encoded on purpose. This catches leaks; it does not
stop deliberate exfiltration.

A finding carries the kind and a JSON-pointer path, never the matched text. The
path is made of member names, which the scan has already checked.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

import orjson

try:  # built from _textstats.c where a compiler was at hand; else the Python below
    from ztate.services.policy import _textstats
except ImportError:  # pragma: no cover - depends on the build
    _textstats = None  # type: ignore[assignment]  # None: the fallback below

__all__ = ["CredentialFinding", "find_credential"]


@dataclass(frozen=True, slots=True)
class CredentialFinding:
    """Where a credential-looking string sits in a value, and what it looks like."""

    kind: str
    path: str


# --- stage 1: prefilter --------------------------------------------------------------

_TOKEN_CHARS: Final = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-"
_SKELETON: Final = bytes(0x61 if byte in _TOKEN_CHARS else 0x20 for byte in range(256))
_RUN_16: Final = "a" * 16  # the shortest Bearer/Basic token prefix
_RUN_20: Final = "a" * 20  # the shortest format below is a 20-character AWS key id
_RUN_32: Final = "a" * 32  # the shortest high-entropy candidate
_URL_USERINFO: Final = re.compile(r"://[^\s/?#@]*@", re.ASCII)
# A tab is the two characters \t once JSON-escaped, hence the second alternative.
_AUTH_SCHEME: Final = re.compile(r"b(?:earer|asic)(?:[ \t]|\\t)+[a-z0-9+/_-]{16}")
_SHORTEST: Final = 7  # "://:p@h"; shorter strings match no rule


def _skeleton(data: bytes) -> str:
    """``data`` (UTF-8) with token characters as ``a`` and every other byte a space.

    A ``str``, because ``in`` on short ``bytes`` costs six times as much.
    """
    return data.translate(_SKELETON).decode("latin-1")


def _may_hold(text: str, skeleton: str) -> bool:
    """False only if no rule can match ``text``: a cheap superset of all of them."""
    if _RUN_16 in skeleton:
        if _RUN_20 in skeleton:
            return True
        lowered = text.lower()
        if ("bearer" in lowered or "basic" in lowered) and _AUTH_SCHEME.search(lowered):
            return True
    return "PRIVATE KEY" in text or ("@" in text and _URL_USERINFO.search(text) is not None)


# --- stage 2: well-known formats ----------------------------------------------------

_WORD: Final = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_DIGIT: Final = re.compile(r"[0-9]")
_WORDY: Final = 4.5  # runs whose words average this or more are never random

# Sources: detect-secrets 1.5 plugins (aws, private_key, github_token, gitlab_token,
# slack, stripe, jwt, basic_auth, openai, pypi_token) and gitleaks config/gitleaks.toml
# (aws-access-token, github-*, gitlab-*, slack-*, stripe-access-token, gcp-api-key,
# npm-access-token, huggingface-access-token, anthropic-api-key, openai-api-key, jwt).
# Every pattern spans a run of >= 20 token characters, "PRIVATE KEY", "://...@", or
# bearer/basic + a 16-character run, which is what _may_hold relies on. Each pattern
# starts with a literal where it can, so that re skips ahead to it quickly, and checks
# the character before it with a lookbehind placed after that literal.

_Classify = Callable[[re.Match[str]], str | None]


@dataclass(frozen=True, slots=True)
class _Rule:
    needs: str  # tried only on text holding this (lower-cased text if ``lowered``)
    pattern: re.Pattern[str]
    classify: _Classify
    lowered: bool = False


_AWS_SAK_KIND: Final = "AWS secret access key"  # SAK: secret access key


def _kind(kind: str) -> _Classify:
    return lambda match: kind


def _private_key(match: re.Match[str]) -> str:
    header = match[0]
    if "OPENSSH" in header:
        return "OpenSSH private key"
    return "PGP private key block" if "PGP" in header else "PEM private key"


# One byte a character: 1 for a digit, a lower-case or an upper-case letter.
_DIGITS: Final = bytes(1 if 48 <= b <= 57 else 0 for b in range(256))
_LOWER: Final = bytes(1 if 97 <= b <= 122 else 0 for b in range(256))
_UPPER: Final = bytes(1 if 65 <= b <= 90 else 0 for b in range(256))


def _mean_word_length(text: str) -> float:
    """Mean length of the words in ``text``: about 1.8 when random, 4 and up when not.

    The words are the ``_WORD`` matches. In ASCII text they cover every letter and
    digit, and one starts at a digit after a non-digit, a lower-case letter after a
    non-letter, a capital after a non-capital, and at the last capital of a run that
    lower-case letters follow: counted on one-byte-a-character masks, in C.
    """
    if not text.isascii():
        rest, words = _WORD.subn("", text)
        return (len(text) - len(rest)) / words if words else math.inf
    data = text.encode("ascii")
    if _textstats is not None:
        letters, words = _textstats.words(data)
        return letters / words if words else math.inf
    digit = int.from_bytes(data.translate(_DIGITS), "big")  # the first character highest
    lower = int.from_bytes(data.translate(_LOWER), "big")
    upper = int.from_bytes(data.translate(_UPPER), "big")
    # x >> 8: "the previous character is x"; x << 8: "the next character is x"
    words = (
        (digit & ~(digit >> 8)).bit_count()
        + (lower & ~((lower | upper) >> 8)).bit_count()
        + (upper & ~(upper >> 8)).bit_count()
        + (upper & (upper >> 8) & (lower << 8)).bit_count()
    )
    letters = digit.bit_count() + lower.bit_count() + upper.bit_count()
    return letters / words if words else math.inf


def _api_key(match: re.Match[str]) -> str | None:
    body = match[1]
    if not _DIGIT.search(body) or _mean_word_length(body) >= _WORDY:
        return None  # a hyphenated phrase such as "sk-learn-..."
    return "Anthropic API key" if body.startswith("ant-") else "OpenAI-style API key"


def _b64decode(text: str, *, urlsafe: bool) -> bytes | None:
    padded = text + "=" * (-len(text) % 4)
    try:
        if urlsafe:
            return base64.urlsafe_b64decode(padded)
        return base64.b64decode(padded, validate=True)
    except ValueError:  # binascii.Error
        return None


def _jwt(match: re.Match[str]) -> str | None:
    header = _b64decode(match[0].partition(".")[0], urlsafe=True)
    if header is None or (b'"alg"' not in header and b'"typ"' not in header):
        return None
    return "JSON Web Token"


def _bearer(match: re.Match[str]) -> str | None:
    return "bearer token" if _mean_word_length(match[1]) < _WORDY else None


def _basic(match: re.Match[str]) -> str | None:
    raw = _b64decode(match[1], urlsafe=False)
    try:
        text = "" if raw is None else raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text.isprintable() or not text.partition(":")[2]:
        return None
    return "HTTP Basic credential"


# A URL's password that is a placeholder, not a secret: masks (***, xxx), a variable
# (${DB_PASSWORD}, $DB_PASSWORD: upper case), a template ({{ .Password }}), a name in
# brackets ({password}, <your-password>, [pass]: lower-case words), a format
# directive, or a word that says so. Only these shapes: anything in brackets or after
# a $ was taken before, so "{kT9vQ2!mZ}" or "$upErS3cret" passed as a placeholder.
_PLACEHOLDER: Final = re.compile(
    r"\*+|[xX.]+|\$\{[A-Za-z_]\w*\}|\$[A-Z_][A-Z0-9_]*|\{\{ ?\.?[A-Za-z_][\w.]* ?\}\}"
    r"|\{[a-z_][a-z0-9_ -]*\}|<[a-z_][a-z0-9_ -]*>|\[[a-z_][a-z0-9_ -]*\]|%[sd]"
    r"|(?i:password|passwd|pass|pwd|secret|redacted|changeme|your[-_]?password)",
    re.ASCII,
)


def _url_password(match: re.Match[str]) -> str | None:
    return None if _PLACEHOLDER.fullmatch(match[1]) else "URL with embedded password"


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.ASCII)


_RULES: Final = (
    _Rule(
        "PRIVATE KEY",
        _compile(r"BEGIN(?<=-----BEGIN|---- BEGIN) [A-Z0-9 _-]{0,100}?PRIVATE KEY"),
        _private_key,
    ),
    _Rule(
        "PuTTY-User-Key-File-", _compile(r"PuTTY-User-Key-File-[0-9]+:"), _kind("PuTTY private key")
    ),
    _Rule(
        "A",
        _compile(r"A(?<![A-Za-z0-9]A)(?:3T[A-Z0-9]|KIA|SIA|BIA|CCA)[A-Z2-7]{16}(?![A-Za-z0-9])"),
        _kind("AWS access key id"),
    ),
    _Rule(
        "secret",
        _compile(
            r"(?i)aws[\w .-]{0,20}?secret[\w .-]{0,20}?[\s'\"]{0,3}[=:][\s'\"]{0,3}"
            r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])"
        ),
        _kind(_AWS_SAK_KIND),
        lowered=True,
    ),
    _Rule(
        "gh",
        _compile(r"gh(?<![A-Za-z0-9]gh)[pousr]_[A-Za-z0-9]{36,255}"),
        _kind("GitHub token"),
    ),
    _Rule(
        "github_pat_",
        _compile(r"github_pat_(?<![A-Za-z0-9]github_pat_)\w{82,255}"),
        _kind("GitHub token"),
    ),
    _Rule(
        "gl",
        _compile(r"gl(?<![A-Za-z0-9]gl)(?:pat|dt|rt|ptt|ft|soat|cbt|imt|agent|oas)-[\w-]{20,}"),
        _kind("GitLab token"),
    ),
    _Rule(
        "x",
        _compile(r"x(?<![A-Za-z0-9]x)(?:ox[abposre]|app)-[0-9]+-[A-Za-z0-9-]{14,}"),
        _kind("Slack token"),
    ),
    _Rule(
        "hooks.slack.com/",
        _compile(r"hooks\.slack\.com/(?:services|workflows|triggers)/[\w+/-]{20,}"),
        _kind("Slack webhook URL"),
    ),
    _Rule(
        "k_",
        # the literal first (a leading lookbehind made re try every position: 300 µs
        # on 10 KB), the prefix and the character before it checked behind it
        _compile(r"k_(?<=[sr]k_)(?<![A-Za-z0-9][sr]k_)(?:live|test|prod)_[A-Za-z0-9]{20,99}"),
        _kind("Stripe API key"),
    ),
    _Rule("AIza", _compile(r"AIza(?<![\w-]AIza)[\w-]{35}(?![\w-])"), _kind("Google API key")),
    _Rule(
        "npm_",
        _compile(r"npm_(?<![A-Za-z0-9]npm_)[A-Za-z0-9]{36}(?![A-Za-z0-9])"),
        _kind("npm token"),
    ),
    _Rule("pypi-", _compile(r"pypi-AgEIcHlwaS5vcmc[\w-]{50,}"), _kind("PyPI token")),
    _Rule(
        "hf_",
        _compile(r"hf_(?<![A-Za-z0-9]hf_)[A-Za-z]{34}(?![A-Za-z0-9])"),
        _kind("Hugging Face token"),
    ),
    _Rule("sk-", _compile(r"sk-(?<![\w-]sk-)([\w-]{32,})"), _api_key),
    _Rule("eyJ", _compile(r"eyJ(?<![\w-]eyJ)[\w-]{17,}\.eyJ[\w-]{17,}\.[\w-]*"), _jwt),
    _Rule(
        "bearer",
        _compile(
            r"(?i)bearer(?<![A-Za-z0-9]bearer)[ \t]+([A-Za-z0-9+/_-]{16}[A-Za-z0-9._~+/-]*=*)"
        ),
        _bearer,
        lowered=True,
    ),
    _Rule(
        "basic",
        _compile(
            r"(?i)basic(?<![A-Za-z0-9]basic)[ \t]+([A-Za-z0-9+/]{16,}={0,2})(?![A-Za-z0-9+/=])"
        ),
        _basic,
        lowered=True,
    ),
    _Rule("://", _compile(r"://[^\s/?#@:]*:([^\s/?#@]+)@[^\s/?#@]+"), _url_password),
)
_AWS_SECRET_NAME: Final = re.compile(r"(?i)aws.{0,20}secret|secret.?access.?key")
_AWS_SECRET_VALUE: Final = re.compile(r"[A-Za-z0-9/+]{40}")


# Per rule, a character of its literal that tokens rarely hold: ``in`` finds one
# character with memchr, many times faster than a longer literal, so most literals
# are looked for only in text that holds their punctuation.
_GATES: Final = tuple(
    next((char for char in rule.needs if not char.isalnum()), rule.needs) for rule in _RULES
)
# For _textstats.found, which finds many literals in one pass: each rule's literal,
# or where the pattern spells out its prefixes, every prefix it can start with (the
# rule is tried when one of them occurs), over the text or its lower case.
_PREFIXES: Final[dict[str, tuple[str, ...]]] = {
    "A": ("A3T", "AKIA", "ASIA", "ABIA", "ACCA"),
    "gh": tuple(f"gh{kind}_" for kind in "pousr"),
    "gl": tuple(
        f"gl{kind}-"
        for kind in ("pat", "dt", "rt", "ptt", "ft", "soat", "cbt", "imt", "agent", "oas")
    ),
    "x": (*(f"xox{kind}-" for kind in "abposre"), "xapp-"),
    "k_": tuple(f"{s}k_{env}_" for s in "sr" for env in ("live", "test", "prod")),
}


def _masks(rules: list[_Rule]) -> tuple[tuple[bytes, ...], dict[int, int]]:
    """The needles of ``rules`` for _textstats.found, and each rule's bits in its
    answer (by the rule's index in ``_RULES``)."""
    needles: list[bytes] = []
    masks: dict[int, int] = {}
    for rule in rules:
        prefixes = _PREFIXES.get(rule.needs, (rule.needs,))
        masks[_RULES.index(rule)] = ((1 << len(prefixes)) - 1) << len(needles)
        needles += (prefix.encode("ascii") for prefix in prefixes)
    return tuple(needles), masks


_NEEDLES, _PLAIN_MASKS = _masks([rule for rule in _RULES if not rule.lowered])
_LOWERED_NEEDLES, _LOWERED_MASKS = _masks([rule for rule in _RULES if rule.lowered])
# (rule, whether it reads the lower case, its bits), in the order rules are tried
_ORDERED: Final = tuple(
    (rule, rule.lowered, (_LOWERED_MASKS if rule.lowered else _PLAIN_MASKS)[index])
    for index, rule in enumerate(_RULES)
)
# Each lower-case rule's match holds one of these: "aws ... secret =", "Bearer x", "Basic x".
_LOWERED_NEED_ONE_OF: Final = (" ", "\t", "=", ":")


def _rules_present(text: str) -> list[_Rule]:
    """The rules whose literal ``text`` (or its lower case, as the rule says) holds."""
    lowered = text.lower() if any(char in text for char in _LOWERED_NEED_ONE_OF) else ""
    if _textstats is None:
        return [
            rule
            for rule, gate in zip(_RULES, _GATES, strict=True)
            if gate in (searched := lowered if rule.lowered else text) and rule.needs in searched
        ]
    # an ASCII literal occurs in a string exactly when it occurs in its UTF-8
    plain = _textstats.found(text.encode("utf-8", "surrogatepass"), _NEEDLES)
    low = _textstats.found(lowered.encode("utf-8", "surrogatepass"), _LOWERED_NEEDLES)
    if not plain | low:
        return []
    return [rule for rule, lower, mask in _ORDERED if (low if lower else plain) & mask]


def _known_format(text: str) -> str | None:
    for rule in _rules_present(text):
        position = 0
        while match := rule.pattern.search(text, position):
            if kind := rule.classify(match):
                return kind
            position = match.start() + 1  # a refused match may overlap a real one
    return None


# --- stage 2: high entropy ----------------------------------------------------------

_MARGIN: Final = 0.85  # bits below the random expectation; >= 5 spreads of H - E
_MARGIN_WORDY: Final = 0.45  # for runs whose words average 3.5 to 4.5 characters
_WORDISH: Final = 3.5
_CANDIDATE: Final = re.compile(r"[A-Za-z0-9+/_-]{32,}")
_HEX_RUN: Final = re.compile(r"(?<![A-Za-z0-9])(?:0x)?([0-9a-fA-F]{40,})(?![A-Za-z0-9])")
_HEX_SKELETON: Final = bytes(0x68 if chr(b) in string.hexdigits else 0x20 for b in range(256))
_HEX_40: Final = b"h" * 40
_HEX_LIKE: Final = re.compile(r"[0-9a-fA-F+/_-]+")
_STANDARD_RUN: Final = re.compile(r"[A-Za-z0-9+/]{32,}")
_URLSAFE_RUN: Final = re.compile(r"[A-Za-z0-9_-]{32,}")
_LN2: Final = math.log(2)


# The token characters in groups: bytes.translate deletes all but one group (about a
# nanosecond a byte), and str.count counts each of its characters in what is left.
_GROUPS: Final = tuple(
    (bytes(b for b in range(256) if b not in group), tuple(chr(b) for b in group))
    for group in (_TOKEN_CHARS[start : start + 9] for start in range(0, len(_TOKEN_CHARS), 9))
)
_COUNT_IN_C: Final = 256  # shorter text: Counter is as fast


def _counts(text: str) -> list[int]:
    """How often each character of ``text`` occurs, in the order of first occurrence
    (that of ``Counter``, so that the entropy's sum is the same float)."""
    if not text.isascii():
        return list(Counter(text).values())
    data = text.encode("ascii")
    if _textstats is not None:
        return _textstats.counts(data)
    if len(text) < _COUNT_IN_C:
        return list(Counter(text).values())
    if data.translate(None, _TOKEN_CHARS):  # a character outside the groups
        return list(Counter(text).values())
    found: list[tuple[int, int]] = []
    for deleted, chars in _GROUPS:
        kept = data.translate(None, deleted).decode("ascii")
        if kept:
            found.extend((text.find(c), n) for c in chars if (n := kept.count(c)))
    found.sort()
    return [n for _, n in found]


def _entropy(text: str) -> float:
    """Shannon entropy per character of ``text``, in bits."""
    n = len(text)
    return math.log2(n) - sum(c * math.log2(c) for c in _counts(text)) / n


def _expected_entropy(n: int, alphabet: int) -> float:
    """Expected entropy per character of ``n`` uniform draws from ``alphabet`` symbols."""
    return math.log2(alphabet) - (alphabet - 1) / (2 * n * _LN2)


_PLUS_ONE: Final = bytes(range(1, 129)) + bytes(128)  # ASCII b -> b + 1 (127 -> 128)


def _sequential(text: str) -> bool:
    """Mostly runs of consecutive characters, like an alphabet: not random."""
    if len(text) < 2:
        return True
    if text.isascii():  # the runs judged here are: each next == previous + 1, at C speed
        data = text.encode("ascii")
        if _textstats is not None:
            return 2 * _textstats.steps(data) >= len(text) - 1
        nexts = int.from_bytes(data[1:], "big")
        successors = int.from_bytes(data[:-1].translate(_PLUS_ONE), "big")
        steps = (nexts ^ successors).to_bytes(len(data) - 1, "big").count(0)
    else:
        steps = sum(1 for a, b in itertools.pairwise(text) if ord(b) - ord(a) == 1)
    return 2 * steps >= len(text) - 1


def _random_hex(digits: str) -> bool:
    if digits.isdigit() or not _DIGIT.search(digits):
        return False  # a number, or only a-f letters
    threshold = _expected_entropy(len(digits), 16) - _MARGIN
    return _entropy(digits) >= threshold and not _sequential(digits)


def _random_base64(run: str) -> bool:
    if _HEX_LIKE.fullmatch(run):
        return False  # hex and UUIDs: judged by _random_hex or too short to judge
    separated = "+" in run or "/" in run or "_" in run or "-" in run  # _SEPARATOR, at memchr speed
    if not separated and (run.islower() or run.isupper()):
        if not _DIGIT.search(run):
            return False  # one long word
        alphabet, margin = 36, _MARGIN
    else:
        mean = _mean_word_length(run)
        if mean >= _WORDY:
            return False  # identifiers, slugs, paths
        alphabet, margin = 64, _MARGIN if mean < _WORDISH else _MARGIN_WORDY
    threshold = _expected_entropy(len(run), alphabet) - margin
    return _entropy(run) >= threshold and not _sequential(run)


def _candidates(text: str, skeleton: str) -> Iterator[str]:
    """The ``_CANDIDATE`` matches of ``text``: in ASCII text, where ``skeleton`` (one
    character a byte) has runs of 32 or more ``a``, found with ``str.find``."""
    if not text.isascii():
        yield from (match[0] for match in _CANDIDATE.finditer(text))
        return
    position = 0
    # the first 32 a's from a position outside a run start the first long run
    while (start := skeleton.find(_RUN_32, position)) >= 0:
        end = skeleton.find(" ", start + 32)
        position = len(skeleton) if end < 0 else end
        yield text[start:position]


def _high_entropy(text: str, skeleton: str) -> str | None:
    for token in _candidates(text, skeleton):
        hexes = _HEX_40 in token.encode("ascii").translate(_HEX_SKELETON)  # else no _HEX_RUN
        if hexes and any(_random_hex(hexrun[1]) for hexrun in _HEX_RUN.finditer(token)):
            return "high-entropy hex string"
        if ("+" in token or "/" in token) and ("_" in token or "-" in token):
            runs = _STANDARD_RUN.findall(token) + _URLSAFE_RUN.findall(token)
        else:
            runs = [token]
        if any(_random_base64(run) for run in runs):
            return "high-entropy string"
    return None


# --- the walk -----------------------------------------------------------------------


def _text_kind(text: str, high_entropy: bool, aws_secret_member: bool) -> str | None:
    if len(text) < _SHORTEST:
        return None
    skeleton = _skeleton(text.encode("utf-8", "surrogatepass"))
    if not _may_hold(text, skeleton):
        return None
    if kind := _known_format(text):
        return kind
    if aws_secret_member and _AWS_SECRET_VALUE.fullmatch(text):
        return _AWS_SAK_KIND
    return _high_entropy(text, skeleton) if high_entropy and _RUN_32 in skeleton else None


def _names_aws_secret(name: object) -> bool:
    """A member named like ``aws_secret_access_key`` (its value has 40 characters)."""
    return isinstance(name, str) and _AWS_SECRET_NAME.search(name) is not None


def _pointer(path: tuple[str, ...]) -> str:
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in path)


def _walk(value: object, high_entropy: bool) -> CredentialFinding | None:
    """Depth first, in document order; an object's member names before its values."""
    stack: list[tuple[object, tuple[str, ...], bool]] = [(value, (), False)]
    while stack:
        node, path, aws_secret_member = stack.pop()
        if isinstance(node, str):
            if kind := _text_kind(node, high_entropy, aws_secret_member):
                return CredentialFinding(kind, _pointer(path))
        elif isinstance(node, dict):
            for name in node:
                if isinstance(name, str) and (kind := _text_kind(name, high_entropy, False)):
                    return CredentialFinding(f"{kind} in a member name", _pointer(path))
            for name, item in reversed(node.items()):
                aws = isinstance(item, str) and len(item) == 40 and _names_aws_secret(name)
                stack.append((item, (*path, str(name)), aws))
        elif isinstance(node, list | tuple):
            for index in range(len(node) - 1, -1, -1):
                stack.append((node[index], (*path, str(index)), False))
    return None


def find_credential(value: object, *, high_entropy: bool = True) -> CredentialFinding | None:
    """First credential-looking string in a JSON value, or None.

    Scans strings, object member names and nested lists and objects, as produced by
    ``json.loads``. ``high_entropy=False`` turns off only the entropy heuristic, for
    keys a policy marks opaque; the well-known formats always apply.

    A string is judged at once (``_text_kind`` filters it itself); anything else is
    first serialised and filtered whole, so that a large value that cannot hold a
    credential is not walked.
    """
    if type(value) is str:
        kind = _text_kind(value, high_entropy, False)
        return None if kind is None else CredentialFinding(kind, "")
    try:
        serialised = orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: lone surrogates, non-str keys, big ints
        return _walk(value, high_entropy)
    if not _may_hold(serialised.decode(), _skeleton(serialised)):
        return None
    return _walk(value, high_entropy)


_PLAIN_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}\Z")


def shown_name(name: str) -> str:
    """A member name an attacker chose, as an error or the rejections ledger may show
    it: a plain lower-case name that does not look like a credential as itself,
    anything else by the first 16 hex digits of its SHA-256."""
    if _PLAIN_NAME.match(name) and find_credential(name) is None:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    return f"sha256:{digest[:16]}"
