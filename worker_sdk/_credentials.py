"""A worker's certificate, key and CA files, read again when they change.

Short-lived certificates (a day in development, an hour under SPIRE) are replaced
under a running worker; the client asks ``changed()`` before each call and opens a
new channel when it returns new files. A change is seen by ``stat`` (inode, device,
modification time, size), so renaming a new file over the old one (``ztate ca renew``),
rewriting it, or swapping a symlink (Kubernetes secrets) all count. A certificate seen
without its matching key (the two files are replaced one after the other) is not taken,
nor files that are unusable (a key encrypted with a password, a key or certificate key
of a curve cryptography does not support, a file that is not PEM): the old channel
serves on, and the next change of the files is tried again.

The services do the same with their own files (``ztate.services.runtime.reloading``);
this copy exists because a worker installs no server code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from ztate.contract.files import FileTooLarge, read_credentials
from ztate.worker_sdk.errors import HandshakeFailed

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
        except OSError:  # gone, a symlink loop, a folder it may not search: unusable now
            found.append(None)
        else:
            found.append((info.st_ino, info.st_dev, info.st_mtime_ns, info.st_size))
    return tuple(found)


_SPKI_DER = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def refused(kind: str, hint: str) -> HandshakeFailed:
    """A ``HandshakeFailed`` this client names (``kind``) before or after a handshake."""
    return HandshakeFailed(grpc.StatusCode.UNAVAILABLE, kind, hint)


def own_certificate(pems: Pems) -> x509.Certificate:
    """The certificate of ``pems`` once each file is usable and the key is the
    certificate's; else ``HandshakeFailed`` naming the file and why, never its content
    (the service's handshake could only refuse such files). A key encrypted with a
    password is refused: the SDK reads keys without one, as the services do. Each file
    is parsed once."""
    try:
        key = serialization.load_pem_private_key(pems.key, password=None)
    except TypeError:  # cryptography: "password was not given but private key is encrypted"
        raise refused(
            "KEY_UNUSABLE",
            "the key file is encrypted with a password: ztate reads private keys without one",
        ) from None
    except UnsupportedAlgorithm:  # not a ValueError: a curve or key type cryptography lacks
        raise refused(
            "KEY_UNUSABLE", "the key file is a private key of an unsupported algorithm or curve"
        ) from None
    except ValueError:
        raise refused("KEY_UNUSABLE", "the key file is not a PEM private key") from None
    try:
        cert = x509.load_pem_x509_certificate(pems.cert)
        public = cert.public_key()
    except UnsupportedAlgorithm:
        raise refused(
            "CERTIFICATE_UNUSABLE",
            "the certificate file is a certificate for a key of an unsupported algorithm or curve",
        ) from None
    except ValueError:
        raise refused(
            "CERTIFICATE_UNUSABLE", "the certificate file is not a PEM certificate"
        ) from None
    try:
        x509.load_pem_x509_certificates(pems.ca)  # a bundle that does not parse is not taken
    except ValueError:
        raise refused("CA_UNUSABLE", "the CA file is not a PEM certificate bundle") from None
    if key.public_key().public_bytes(*_SPKI_DER) != public.public_bytes(*_SPKI_DER):
        raise refused("KEY_MISMATCH", "the key file is not the private key of the certificate file")
    return cert


def _matching(pems: Pems) -> bool:
    try:
        own_certificate(pems)
    except HandshakeFailed:
        return False
    return True


class CertificateFiles:
    """The three files of a worker's identity."""

    def __init__(self, cert: Path, key: Path, ca: Path) -> None:
        self._paths = (cert, key, ca)
        self._stamp = _stamp(self._paths)
        self._failed: Stamp | None = None
        self.pems = Pems(*read_credentials(cert, key, ca))  # bounded: FileTooLarge

    def changed(self) -> Pems | None:
        """The files' new content if they changed since last taken and are a usable
        certificate with its key, else None."""
        now = _stamp(self._paths)
        if now in (self._stamp, self._failed):
            return None
        try:
            cert, key, ca = read_credentials(*self._paths)
        except OSError:
            return None  # being replaced: the next call sees the files again
        except FileTooLarge:
            self._failed = now  # not read again until the files change again
            return None
        pems = Pems(cert, key, ca)
        if not _matching(pems):
            self._failed = now  # not parsed again until the files change again
            return None
        self._stamp, self.pems = now, pems
        return pems
