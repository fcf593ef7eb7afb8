"""The one client channel (services/cli/context.py ``connect``): every ``ztate`` client
command and ``ztate console`` open it, and it takes any reply a ztate server may legally
send (``tls.MAX_REPLY_BYTES``: a 64 MiB state, two patches and their framing), far past
gRPC's default 4 MiB receive limit.

The server here is a real gRPC server over real mTLS (the test PKI's service certificate,
client certificates required) that answers the ledger calls the console's timeline and
``ztate ledger show`` make, with a detail whose state is 64.5 MiB.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.harness import Pki
from ztate.services.runtime.identity import Role
from ztate.services.runtime.tls import MAX_REPLY_BYTES
from ztate.v1 import ledger_pb2, ledger_pb2_grpc

DIGEST = "cd" * 32
STATE_CHARS = 64 * 1024 * 1024 + 512 * 1024  # past the CLI's old 64 MiB, inside the bound


class BigDetail(ledger_pb2_grpc.LedgerServiceServicer):
    """One thread with one transition, whose kept state is large."""

    def __init__(self) -> None:
        self.state_json = json.dumps({"big": "s" * STATE_CHARS})

    def ListTransitions(self, request: Any, context: Any) -> Any:
        return ledger_pb2.ListTransitionsResponse(
            entries=[
                ledger_pb2.LedgerEntry(
                    thread_id="t-big", version=1, digest=DIGEST, node_id="n", kind="transition"
                )
            ]
        )

    def GetTransitionDetail(self, request: Any, context: Any) -> Any:
        return ledger_pb2.GetTransitionDetailResponse(
            entry=ledger_pb2.LedgerEntry(thread_id="t-big", version=1, digest=DIGEST),
            patch_json='{"k":1}',
            state_json=self.state_json,
            state_kept=True,
        )


@pytest.fixture(scope="module")
def big_server(pki: Pki) -> Iterator[str]:
    service = pki.identity(Role.SERVICE, "transition")
    credentials = grpc.ssl_server_credentials(
        [(service.key.read_bytes(), service.cert.read_bytes())],
        root_certificates=service.ca.read_bytes(),
        require_client_auth=True,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(BigDetail(), server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_the_reply_is_a_large_legal_one() -> None:
    reply = ledger_pb2.GetTransitionDetailResponse(state_json=BigDetail().state_json)
    assert 64 * 1024 * 1024 < reply.ByteSize() < MAX_REPLY_BYTES


def test_ztate_ledger_show_receives_a_large_detail(
    big_server: str,
    pki: Pki,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ztate.services.cli.main import main

    operator = pki.operator()
    monkeypatch.setenv("ZTATE_CONFIG", str(tmp_path / "none.yaml"))
    code = main(
        [
            "ledger",
            "show",
            DIGEST,
            "--address",
            big_server,
            "--client-cert",
            str(operator.cert),
            "--client-key",
            str(operator.key),
            "--ca-cert",
            str(operator.ca),
            "-o",
            "json",
        ]
    )
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert len(json.loads(out)["state"]["big"]) == STATE_CHARS


def test_the_console_timeline_receives_a_large_detail(big_server: str, pki: Pki) -> None:
    """The console's ledger pages (the path that had a channel builder of its own)."""
    from ztate.services.console.backend import Backend, Identity

    operator, reviewer = pki.operator(), pki.identity(Role.REVIEWER, "alice")
    backend = Backend(
        Identity(big_server, operator.cert, operator.key, operator.ca),
        Identity(big_server, reviewer.cert, reviewer.key, reviewer.ca),
    )
    [row] = asyncio.run(backend.timeline("t-big"))
    assert (row["digest"], row["changes"]) == (DIGEST, [("k", "1")])


def test_a_client_key_with_a_password_is_a_usage_error(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client reads its files as the services do (``tls.checked_files``): a key
    encrypted with a password is named, exit 2, before anything is dialled."""
    from cryptography.hazmat.primitives import serialization

    from ztate.services.cli.main import main

    operator = pki.operator()
    key = serialization.load_pem_private_key(operator.key.read_bytes(), password=None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw-5ecret-9c1f"),
        )
    )
    monkeypatch.setenv("ZTATE_CONFIG", str(tmp_path / "none.yaml"))
    code = main(
        [
            *("ledger", "list", "--address", "127.0.0.1:1"),
            *("--client-cert", str(operator.cert), "--client-key", str(locked)),
            *("--ca-cert", str(operator.ca)),
        ]
    )
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == (
        f"ztate: cannot use credentials: {locked} is encrypted with a password: ztate reads "
        "private keys without one (give --client-cert/--client-key/--ca-cert, "
        "ZTATE_CERT/KEY/CA or a context)\n"
    )


# secp112r1 (SEC 2): a curve OpenSSL knows and cryptography refuses with
# UnsupportedAlgorithm (not a ValueError), so ztate cannot use a key on it
SECP112R1_OID = bytes.fromhex("06052b81040006")  # 1.3.132.0.6
SECP112R1_P = 0xDB7C2ABF62E35E668076BEAD208B
SECP112R1_A = 0xDB7C2ABF62E35E668076BEAD2088
SECP112R1_B = 0x659EF8BA043916EEDE8911702B22
SECP112R1_G = (0x09487239995A5EE76B55F9C2F098, 0xA89CE5AF8724C0A23E0E0FF77500)
SECP112R1_N = 0xDB7C2ABF62E35E7628DFAC6561C5
EC_PUBLIC_KEY_OID = bytes.fromhex("06072a8648ce3d0201")  # 1.2.840.10045.2.1


def _der(tag: int, body: bytes) -> bytes:
    size = len(body)
    if size < 0x80:
        return bytes([tag, size]) + body
    length = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(length)]) + length + body


def _der_body(encoded: bytes) -> bytes:
    """The contents of one DER element (its tag and length dropped)."""
    first = encoded[1]
    start = 2 if first < 0x80 else 2 + (first & 0x7F)
    return encoded[start:]


def _times(point: tuple[int, int], scalar: int) -> tuple[int, int]:
    """``scalar`` times ``point`` on secp112r1 (affine double-and-add)."""
    result: tuple[int, int] | None = None
    addend = point
    while scalar:
        if scalar & 1:
            result = addend if result is None else _add(result, addend)
        addend = _add(addend, addend)
        scalar >>= 1
    assert result is not None
    return result


def _add(one: tuple[int, int], two: tuple[int, int]) -> tuple[int, int]:
    p = SECP112R1_P
    if one == two:
        slope = (3 * one[0] * one[0] + SECP112R1_A) * pow(2 * one[1], -1, p) % p
    else:
        slope = (two[1] - one[1]) * pow(two[0] - one[0], -1, p) % p
    x = (slope * slope - one[0] - two[0]) % p
    return x, (slope * (one[0] - x) - one[1]) % p


def secp112r1_key_pair() -> tuple[bytes, bytes]:
    """A new key pair on secp112r1: its private key as SEC 1 PEM (RFC 5915), and its
    public key as DER SubjectPublicKeyInfo (RFC 5480). Made here: cryptography cannot."""
    import base64
    import secrets

    scalar = 1 + secrets.randbelow(SECP112R1_N - 1)
    x, y = _times(SECP112R1_G, scalar)
    assert (y * y - x**3 - SECP112R1_A * x - SECP112R1_B) % SECP112R1_P == 0  # on the curve
    point = b"\x04" + x.to_bytes(14, "big") + y.to_bytes(14, "big")
    private = _der(
        0x30,
        _der(0x02, b"\x01")
        + _der(0x04, scalar.to_bytes(14, "big"))
        + _der(0xA0, SECP112R1_OID)
        + _der(0xA1, _der(0x03, b"\x00" + point)),
    )
    spki = _der(0x30, _der(0x30, EC_PUBLIC_KEY_OID + SECP112R1_OID) + _der(0x03, b"\x00" + point))
    body = base64.encodebytes(private).decode()
    return f"-----BEGIN EC PRIVATE KEY-----\n{body}-----END EC PRIVATE KEY-----\n".encode(), spki


def certificate_for(spki: bytes, pki: Pki) -> bytes:
    """A certificate the test CA signs for the public key ``spki``, whatever its curve:
    cryptography builds one for a stand-in key; its key is then replaced and the
    certificate signed again."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = serialization.load_pem_private_key((pki.ca_dir / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificate((pki.ca_dir / "ca.crt").read_bytes())
    stand_in = ec.generate_private_key(ec.SECP256R1()).public_key()
    now = datetime.datetime.now(datetime.UTC)
    built = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "unsupported")]))
        .issuer_name(ca_cert.subject)
        .public_key(stand_in)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(hours=1))
        .sign(ca_key, hashes.SHA256())
    )
    stand_in_spki = stand_in.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    tbs_body = _der_body(built.tbs_certificate_bytes)
    assert tbs_body.count(stand_in_spki) == 1
    tbs = _der(0x30, tbs_body.replace(stand_in_spki, spki))
    whole = _der_body(built.public_bytes(serialization.Encoding.DER))
    after_tbs = whole[len(built.tbs_certificate_bytes) :]
    algorithm = after_tbs[: 2 + after_tbs[1]]  # the signature's AlgorithmIdentifier
    signature = ca_key.sign(tbs, ec.ECDSA(hashes.SHA256()))
    der = _der(0x30, tbs + algorithm + _der(0x03, b"\x00" + signature))
    cert = x509.load_der_x509_certificate(der)
    ca_key.public_key().verify(
        cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_a_key_pair_on_an_unsupported_curve_is_a_usage_error(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A private key, or a certificate's key, of an algorithm or curve cryptography does
    not support (its UnsupportedAlgorithm is no ValueError) is refused as any unusable
    key file is: named, exit 2, one line, no traceback, none of the file's content."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    from ztate.services.cli.main import main

    key_pem, spki = secp112r1_key_pair()
    with pytest.raises(UnsupportedAlgorithm):  # the premise: a key cryptography refuses
        serialization.load_pem_private_key(key_pem, password=None)
    operator = pki.operator()
    key = tmp_path / "secp112r1.key"
    key.write_bytes(key_pem)
    cert = tmp_path / "secp112r1.crt"
    cert.write_bytes(certificate_for(spki, pki))
    monkeypatch.setenv("ZTATE_CONFIG", str(tmp_path / "none.yaml"))
    hint = "(give --client-cert/--client-key/--ca-cert, ZTATE_CERT/KEY/CA or a context)"
    for given_cert, given_key, said in (
        (cert, key, f"{key} is a private key of an unsupported algorithm or curve"),
        (
            cert,
            operator.key,
            f"{cert} is a certificate for a key of an unsupported algorithm or curve",
        ),
    ):
        code = main(
            [
                *("ledger", "list", "--address", "127.0.0.1:1"),
                *("--client-cert", str(given_cert), "--client-key", str(given_key)),
                *("--ca-cert", str(operator.ca)),
            ]
        )
        out, err = capsys.readouterr()
        assert (code, out) == (2, "")
        assert err == f"ztate: cannot use credentials: {said} {hint}\n"
