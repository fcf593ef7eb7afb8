"""Reading a file whose content has a natural bound (a keyring, public keys, a signing
key, a signature, a manifest, a policy): never more than the bound in memory, whatever
the file turns out to be (a link to /dev/zero, a file that keeps growing, a huge one).
Pipes are read too (``--keyring <(vault ...)``), up to the same bound."""

from __future__ import annotations

from pathlib import Path

# A certificate or a private key in PEM: a few kilobytes, a long chain some tens.
MAX_PEM_FILE_BYTES = 1024 * 1024
# A CA bundle: every CA trusted during a rotation, or a system bundle (about 200 KB).
MAX_CA_BUNDLE_BYTES = 4 * 1024 * 1024


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


def read_credentials(
    cert: str | Path, key: str | Path, ca: str | Path
) -> tuple[bytes, bytes, bytes]:
    """The PEM bytes of a certificate, its key and a CA bundle, each read no further than
    its kind ever needs (``FileTooLarge``, a ``ValueError``, past it; ``OSError`` as
    opening or reading raises it)."""
    return (
        read_bounded(cert, MAX_PEM_FILE_BYTES, "a certificate"),
        read_bounded(key, MAX_PEM_FILE_BYTES, "a private key"),
        read_bounded(ca, MAX_CA_BUNDLE_BYTES, "a CA bundle"),
    )
