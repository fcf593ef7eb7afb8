"""The credential scan's verdicts over generated strings, frozen (``verdicts.json``).

``python -m tests.vectors.credentials.generate`` writes the file from the scan as it is;
tests/unit/test_credentials.py checks the scan still gives every verdict. It was first
written by the scan before its entropy and word statistics were rewritten to run in C
(bytes.translate and str.count instead of Counter and re.subn), so the rewrite provably
flags exactly what the old code flagged, kind and path included, on these strings.

The strings come from one fixed seed: random runs over the alphabets the entropy rule
distinguishes (hex, base32, single-case, alphanumeric, both base64 alphabets, mixed),
at lengths around its thresholds, with low-entropy variants (few symbols), words,
identifiers, sequences, near-miss and real well-known prefixes, and prose around them.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

from ztate.services.policy.credentials import find_credential

SEED = 19
COUNT = 4_000
HERE = Path(__file__).parent
VERDICTS = HERE / "verdicts.json"

ALPHABETS = (
    "0123456789abcdef",
    "0123456789ABCDEF",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567",
    string.ascii_lowercase + string.digits,
    string.ascii_uppercase + string.digits,
    string.ascii_lowercase,
    string.ascii_letters + string.digits,
    string.ascii_letters + string.digits + "+/",
    string.ascii_letters + string.digits + "_-",
    string.ascii_letters + string.digits + "+/_-",
    string.ascii_letters + string.digits + "+/_-.:@ =",
    string.printable,
)
PREFIXES = ("", "", "", "sk-", "ghp_", "AKIA", "AIza", "xoxb-1-", "0x", "glpat-", "hf_", "npm_")
WORDS = ("state", "refund", "Order", "planner", "ID", "http", "json", "Key", "v2", "x86_64")


def _run(rng: random.Random) -> str:
    alphabet = rng.choice(ALPHABETS)
    if rng.random() < 0.3:  # a low-entropy variant: a few symbols of the alphabet
        alphabet = "".join(rng.sample(alphabet, rng.randint(2, min(12, len(alphabet)))))
    length = rng.choice((rng.randint(16, 48), rng.randint(30, 70), rng.randint(70, 400)))
    return "".join(rng.choice(alphabet) for _ in range(length))


def _string(rng: random.Random) -> str:
    shape = rng.randrange(6)
    if shape == 0:
        return rng.choice(PREFIXES) + _run(rng)
    if shape == 1:  # identifiers and slugs: words joined
        sep = rng.choice(("", "_", "-", "/"))
        return sep.join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
    if shape == 2:  # words and random runs mixed
        return "".join(rng.choice((rng.choice(WORDS), _run(rng)[:12])) for _ in range(8))
    if shape == 3:  # a sequence with noise
        start = rng.randrange(20)
        seq = (string.ascii_letters + string.digits)[start : start + rng.randint(32, 45)]
        return "".join(c if rng.random() < 0.8 else rng.choice(string.digits) for c in seq)
    if shape == 4:  # prose around a run
        return f"see {rng.choice(PREFIXES)}{_run(rng)} in the {rng.choice(WORDS)} log"
    return _run(rng)


def strings() -> list[str]:
    rng = random.Random(SEED)
    return [_string(rng) for _ in range(COUNT)]


def verdicts() -> list[Any]:
    """Per string: the finding with and without the entropy rule, as [kind, path] or None."""
    out: list[Any] = []
    for text in strings():
        row = []
        for high_entropy in (True, False):
            found = find_credential({"v": text}, high_entropy=high_entropy)
            row.append(None if found is None else [found.kind, found.path])
        out.append(row)
    return out


if __name__ == "__main__":
    VERDICTS.write_text(json.dumps(verdicts(), separators=(",", ":")) + "\n")
