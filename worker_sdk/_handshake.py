"""Why a TLS handshake with the service failed, in words a worker's operator can act on.

The service verifies client certificates in the TLS handshake (docs/api.md, "Refusals
before any RPC"), so gRPC reports a refused certificate as UNAVAILABLE, exactly like a
service that is down. Two things tell them apart:

- ``check_own_certificate`` reads the worker's own files before any call: a key that is
  not the certificate's, a file cryptography cannot use (an encrypted key, a curve it
  does not support, not PEM), or a certificate outside its validity period, can only
  fail.
- ``diagnose`` runs when a call failed in transport without a ztate reason: it opens one
  TLS connection of its own with the same certificate, key and CA, and sees which side
  gave up (our CA does not trust the server, the server's certificate does not name
  the host, the server closed the connection on our certificate) or that nothing
  answers at all (unreachable).

Nothing here reads or reports a private key: only certificates' names, dates and
issuers appear in a hint.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm

from ztate.worker_sdk._credentials import Pems, own_certificate, refused
from ztate.worker_sdk.errors import HandshakeFailed, Unreachable

PROBE_SECONDS = 5.0
# The HTTP/2 client preface and an empty SETTINGS frame: a gRPC server that accepted our
# certificate answers with its own SETTINGS.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
HOSTNAME_MISMATCH = 62  # X509_V_ERR_HOSTNAME_MISMATCH
IP_ADDRESS_MISMATCH = 64  # X509_V_ERR_IP_ADDRESS_MISMATCH


def check_own_certificate(pems: Pems, *, now: datetime | None = None) -> None:
    """Raise ``HandshakeFailed`` for files the service's handshake can only refuse:
    an unusable file or a key that is not the certificate's (``own_certificate``), a
    certificate expired or not yet valid."""
    cert = own_certificate(pems)
    now = now or datetime.now(UTC)
    if now >= cert.not_valid_after_utc:
        raise refused(
            "CERTIFICATE_EXPIRED",
            f"the client certificate expired at {cert.not_valid_after_utc.isoformat()}: the "
            "service refuses it in the TLS handshake; renew it (ztate ca renew)",
        )
    if now < cert.not_valid_before_utc:
        raise refused(
            "CERTIFICATE_NOT_YET_VALID",
            f"the client certificate is valid only from {cert.not_valid_before_utc.isoformat()} "
            "(is this machine's clock right?): the service refuses it until then",
        )


def _issued_by_ca(pems: Pems) -> bool:
    """Whether a certificate of the CA file signed the client certificate. A CA
    certificate whose key cryptography cannot load (``UnsupportedAlgorithm``: a curve
    it lacks; the bundle still parses, so ``own_certificate`` took it) signed nothing
    this can check: skipped, as one whose signature does not verify."""
    cert = x509.load_pem_x509_certificate(pems.cert)
    for authority in x509.load_pem_x509_certificates(pems.ca):
        try:
            cert.verify_directly_issued_by(authority)
        except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
            continue
        return True
    return False


@contextlib.contextmanager
def _pem_path(content: bytes, name: str) -> Iterator[str]:
    """A path ``ssl`` can load ``content`` from: an anonymous memory file on Linux, so the
    key is never written to a disk; elsewhere a file only this user can read, in a
    private folder, deleted at once."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.write(fd, content)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="ztate-probe-") as folder:  # mode 0700
        path = os.path.join(folder, name)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(content)
        yield path


def _split(target: str) -> tuple[str, int]:
    target = target.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


# Alerts a TLS server sends about the client's certificate (OpenSSL's reason names);
# any other failure during the handshake says nothing about our certificate.
CERTIFICATE_ALERTS = ("CERTIFICATE", "UNKNOWN_CA", "ACCESS_DENIED")


def _refused_hint(pems: Pems, detail: str) -> HandshakeFailed:
    if not _issued_by_ca(pems):
        issuer = x509.load_pem_x509_certificate(pems.cert).issuer.rfc4514_string()
        why = (
            f"the client certificate is not issued by the CA file's CA (its issuer is "
            f"{issuer}): the service trusts only certificates of its own CA"
        )
    else:
        why = (
            "the service does not trust this certificate: its CA is unknown to the "
            "service, or the service revoked it at the TLS layer"
        )
    return refused("CERTIFICATE_REFUSED", f"the service refused our certificate ({detail}): {why}")


def diagnose(
    target: str, pems: Pems, server_name: str | None = None, timeout: float = PROBE_SECONDS
) -> HandshakeFailed | Unreachable | None:
    """What one TLS connection of our own says about ``target``: a typed error naming the
    likely reason, or None when the handshake and HTTP/2 work (not a certificate
    problem). Blocking: run it in a thread."""
    try:
        host, port = _split(target)
    except ValueError:
        return None
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError as error:
        return Unreachable(
            grpc.StatusCode.UNAVAILABLE,
            "UNREACHABLE",
            f"the service at {target} is unreachable ({error.strerror or error}): "
            "is it running, and is this its address?",
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=pems.ca.decode("ascii", "replace"))
    context.set_alpn_protocols(["h2"])
    name = server_name or host
    with raw, _pem_path(pems.cert, "cert") as cert, _pem_path(pems.key, "key") as key:
        context.load_cert_chain(cert, key)
        try:
            with context.wrap_socket(raw, server_hostname=name) as tls:
                tls.sendall(H2_PREFACE)
                answer = tls.recv(9)
        except ssl.SSLCertVerificationError as error:
            if error.verify_code in (HOSTNAME_MISMATCH, IP_ADDRESS_MISMATCH):
                return refused(
                    "SERVER_NAME_MISMATCH",
                    f"the service's certificate does not name {name!r}: connect with the "
                    "name in its certificate, or pass server_name",
                )
            return refused(
                "SERVER_NOT_TRUSTED",
                f"our CA does not trust the service's certificate ({error.verify_message}): "
                "the CA file is not the CA that signed the service's certificate",
            )
        except ssl.SSLError as error:
            if any(word in (error.reason or "") for word in CERTIFICATE_ALERTS):
                return _refused_hint(pems, error.reason or "TLS alert")
            return None  # not a TLS server, or it broke off: not shown to be the certificate
        except OSError:  # closed before the handshake ended (a proxy whose backend is
            return None  # down, a port that is not ours): no verdict on the certificate
    if not answer:
        return _refused_hint(pems, "connection closed after the handshake")
    return None
