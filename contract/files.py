"""Reading a file whose content has a natural bound (a keyring, public keys, a signing
key, a signature, a manifest, a policy): never more than the bound in memory, whatever
the file turns out to be (a link to /dev/zero, a file that keeps growing, a huge one).
Pipes are read too (``--keyring <(vault ...)``), up to the same bound."""

from __future__ import annotations

from pathlib import Path


class FileTooLarge(ValueError):
    """A file holding more than its kind of content ever needs; the message names it."""


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of ``path`` (``what`` it holds, for the message), at most ``limit`` of
    them: ``FileTooLarge`` when it holds more, read no further. ``OSError`` as opening
    or reading raises it."""
    with Path(path).open("rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise FileTooLarge(f"{path}: more than {limit:,} bytes, too large for {what}")
    return data
