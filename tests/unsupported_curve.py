"""A real key pair on a curve cryptography does not support (secp112r1, SEC 2), and a
certificate for it: cryptography raises ``UnsupportedAlgorithm`` (not a ``ValueError``)
for either, so every reader of key files must say so as it says any key is unusable.
cryptography cannot make such a key, so it is made here: a random scalar, its public
point by double-and-add, the DER of RFC 5915 and RFC 5480."""

from __future__ import annotations

from tests.harness import Pki

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


def certificate_for(spki: bytes, pki: Pki, *, common_name: str = "unsupported") -> bytes:
    """A certificate the test CA signs for the public key ``spki``, whatever its curve,
    named ``common_name``: cryptography builds one for a stand-in key; its key is then
    replaced and the certificate signed again."""
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
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
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
