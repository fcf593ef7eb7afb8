"""Mutual TLS for every ztate port and every call between ztate processes.

Servers require a client certificate signed by a trusted CA (verified in the
handshake); clients present their own certificate and verify the server's.

A server reads its certificate, key and trusted CA bundle again when the files change
(``ztate.services.runtime.reloading``): gRPC asks for them at every handshake, so new
connections use the new files while connections already open keep theirs. That is all
rotation needs, whoever replaces the files (``ztate ca renew``, cert-manager, SPIRE).
The bundle may hold several CA certificates: during a CA rotation, the old and the new.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes, PublicKeyTypes

from ztate.contract.errors import KeyFileError
from ztate.contract.files import read_credentials
from ztate.services.runtime.reloading import WatchedFiles

_SPKI_DER = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _same_public_key(key: PrivateKeyTypes, public: PublicKeyTypes) -> bool:
    return key.public_key().public_bytes(*_SPKI_DER) == public.public_bytes(*_SPKI_DER)


def private_key(pem: bytes, path: Path) -> PrivateKeyTypes:
    """The private key in ``pem`` (read from ``path``), else a ``KeyFileError`` naming
    the file and why, never its content. A key encrypted with a password is refused:
    ztate reads keys without one (protect the file, or the secret that holds it)."""
    try:
        return serialization.load_pem_private_key(pem, password=None)
    except TypeError:  # cryptography: "password was not given but private key is encrypted"
        raise KeyFileError(
            f"{path} is encrypted with a password: ztate reads private keys without one"
        ) from None
    except UnsupportedAlgorithm:  # not a ValueError: a curve or type cryptography lacks
        raise KeyFileError(
            f"{path} is a private key of an unsupported algorithm or curve"
        ) from None
    except ValueError:
        raise KeyFileError(f"{path} is not a PEM private key") from None


def checked_files(cert: Path, key: Path, ca: Path) -> tuple[bytes, bytes, bytes]:
    """The PEM of ``cert``, ``key`` and the CA bundle ``ca``, each usable: else a
    ``KeyFileError`` (a ``ValueError``) naming the file and why, never its content. A
    key encrypted with a password is refused: ztate reads keys without one (protect the
    file, or the secret that holds it). Each file is parsed once."""
    cert_pem, key_pem, ca_pem = read_credentials(cert, key, ca)  # bounded: FileTooLarge
    private = private_key(key_pem, key)
    try:
        public = x509.load_pem_x509_certificate(cert_pem).public_key()
    except UnsupportedAlgorithm:
        raise KeyFileError(
            f"{cert} is a certificate for a key of an unsupported algorithm or curve"
        ) from None
    except ValueError:
        raise KeyFileError(f"{cert} is not a PEM certificate") from None
    try:
        x509.load_pem_x509_certificates(ca_pem)  # a bundle that does not parse is not taken
    except ValueError:
        raise KeyFileError(f"{ca} is not a PEM certificate bundle") from None
    if not _same_public_key(private, public):
        raise KeyFileError(f"{key} is not the key of {cert}")
    return cert_pem, key_pem, ca_pem


def _certificate_configuration(
    cert: Path, key: Path, ca: Path
) -> grpc.ServerCertificateConfiguration:
    cert_pem, key_pem, ca_pem = checked_files(cert, key, ca)
    return grpc.ssl_server_certificate_configuration(
        [(key_pem, cert_pem)], root_certificates=ca_pem
    )


def server_credentials(cert: Path, key: Path, ca: Path) -> grpc.ServerCredentials:
    """A client certificate signed by a CA of ``ca`` is required of every caller; the three
    files are read again when they change, for the handshakes that follow."""
    files = WatchedFiles(
        f"server certificate {cert}",
        (cert, key, ca),
        lambda: _certificate_configuration(cert, key, ca),
    )

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # called by gRPC at every handshake: None keeps the configuration in use
        return files.value if files.refresh() else None

    # grpc-stubs omit that the fetcher may return None ("unchanged"), as grpc documents
    return grpc.dynamic_ssl_server_credentials(
        files.value,
        fetch,  # type: ignore[arg-type]
        require_client_authentication=True,
    )


# The largest reply any ztate server can be configured to send (Settings.max_reply_bytes
# at the highest state and patch limits): clients accept it, so no legal reply is cut.
MAX_REPLY_BYTES = 3 * 64 * 1024 * 1024 + 64 * 1024  # a revert's detail at the limits


def client_options(server_name: str | None) -> list[tuple[str, Any]]:
    """The options of every ztate client channel: any legal reply accepted, the server
    name checked as given."""
    options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_REPLY_BYTES)]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


def _channel_credentials(cert: Path, key: Path, ca: Path) -> grpc.ChannelCredentials:
    cert_pem, key_pem, ca_pem = checked_files(cert, key, ca)
    return grpc.ssl_channel_credentials(ca_pem, key_pem, cert_pem)


class ServiceChannel:
    """A long-lived channel from one service to another, as the calling service's
    identity, built again when its certificate, key or CA files change.

    For a caller that makes one call at a time (the approval outbox, receipt delivery):
    ``channel()`` before each call; the previous channel, idle then, is closed.
    """

    def __init__(
        self, target: str, cert: Path, key: Path, ca: Path, *, server_name: str | None = None
    ) -> None:
        self._target = target
        self._options = client_options(server_name)
        self._files = WatchedFiles(
            f"client certificate {cert}",
            (cert, key, ca),
            lambda: _channel_credentials(cert, key, ca),
        )
        self._channel = self._open()

    def _open(self) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(self._target, self._files.value, options=self._options)

    async def channel(self) -> grpc.aio.Channel:
        """The channel for the next call, a new one if the files changed."""
        if self._files.refresh():
            previous, self._channel = self._channel, self._open()
            await previous.close(None)
        return self._channel

    async def close(self) -> None:
        await self._channel.close(None)
