"""A worker's certificate, key and CA files, read again when they change.

Short-lived certificates (a day in development, an hour under SPIRE) are replaced
under a running worker; the client asks ``changed()`` before each call and opens a
new channel when it returns new files. A change is seen by ``stat`` (inode, device,
modification time, size), so renaming a new file over the old one (``ztate ca renew``),
rewriting it, or swapping a symlink (Kubernetes secrets) all count. A certificate seen
without its matching key (the two files are replaced one after the other) is not taken:
the next change of the files is tried again.

The services do the same with their own files (``ztate.services.runtime.reloading``);
this copy exists because a worker installs no server code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

Stamp = tuple[tuple[int, int, int, int] | None, ...]


@dataclass(frozen=True, slots=True)
class Pems:
    """What a channel is built from."""

    cert: bytes
    key: bytes
    ca: bytes


def _stamp(paths: tuple[Path, ...]) -> Stamp:
    found: list[tuple[int, int, int, int] | None] = []
    for path in paths:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            found.append(None)
        else:
            found.append((info.st_ino, info.st_dev, info.st_mtime_ns, info.st_size))
    return tuple(found)


def _matching(pems: Pems) -> bool:
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    try:
        cert = x509.load_pem_x509_certificate(pems.cert)
        key = serialization.load_pem_private_key(pems.key, password=None)
        x509.load_pem_x509_certificates(pems.ca)
    except ValueError:
        return False
    return bool(
        key.public_key().public_bytes(der, public) == cert.public_key().public_bytes(der, public)
    )


class CertificateFiles:
    """The three files of a worker's identity."""

    def __init__(self, cert: Path, key: Path, ca: Path) -> None:
        self._paths = (cert, key, ca)
        self._stamp = _stamp(self._paths)
        self._failed: Stamp | None = None
        self.pems = Pems(cert.read_bytes(), key.read_bytes(), ca.read_bytes())

    def changed(self) -> Pems | None:
        """The files' new content if they changed since last taken and are a usable
        certificate with its key, else None."""
        now = _stamp(self._paths)
        if now in (self._stamp, self._failed):
            return None
        try:
            cert, key, ca = (path.read_bytes() for path in self._paths)
        except OSError:
            return None  # being replaced: the next call sees the files again
        pems = Pems(cert, key, ca)
        if not _matching(pems):
            self._failed = now  # not parsed again until the files change again
            return None
        self._stamp, self.pems = now, pems
        return pems
