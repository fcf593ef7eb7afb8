"""The worker SDK on certificate and key files it cannot use (real files: a key pair on
secp112r1, a curve cryptography refuses with UnsupportedAlgorithm, and a certificate the
test CA signs for it; a key encrypted with a password). At start-up ``from_files``
raises ``HandshakeFailed`` naming the file and why, never its content, with no
traceback of cryptography's; rotated in under a running client, such files are skipped:
the old channel serves on and the files are not parsed again until they change."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from tests.harness import Credentials, Pki
from tests.unit.test_sdk_runner import Scripted, scripted_server
from tests.unsupported_curve import certificate_for, secp112r1_key_pair
from ztate.services.cli import ca
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.reloading import write_atomically
from ztate.worker_sdk import HandshakeFailed, ZtateClient
from ztate.worker_sdk import _credentials as credentials_module


def encrypted(key: Path) -> bytes:
    """``key``, the same private key, encrypted with a password."""
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    return private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"a password"),
    )


def mine(pki: Pki, folder: Path) -> Credentials:
    """A copy of a node's files that this test may replace."""
    node = pki.node("db-writer")
    folder.mkdir()
    for path in (node.cert, node.key, node.ca):
        shutil.copy(path, folder / path.name)
    return Credentials(folder / node.cert.name, folder / node.key.name, folder / node.ca.name)


UNUSABLE = {
    "a key on an unsupported curve": (
        "KEY_UNUSABLE",
        "the key file is a private key of an unsupported algorithm or curve",
    ),
    "a certificate for a key on an unsupported curve": (
        "CERTIFICATE_UNUSABLE",
        "the certificate file is a certificate for a key of an unsupported algorithm or curve",
    ),
    "a key encrypted with a password": (
        "KEY_UNUSABLE",
        "the key file is encrypted with a password: ztate reads private keys without one",
    ),
    "a key that is not PEM": ("KEY_UNUSABLE", "the key file is not a PEM private key"),
    "a CA file that is not PEM": ("CA_UNUSABLE", "the CA file is not a PEM certificate bundle"),
}


def make_unusable(case: str, files: Credentials, pki: Pki) -> None:
    if case in ("a key on an unsupported curve", "a certificate for a key on an unsupported curve"):
        key_pem, spki = secp112r1_key_pair()
        write_atomically(files.cert, certificate_for(spki, pki), 0o644)
        if case == "a key on an unsupported curve":
            write_atomically(files.key, key_pem, 0o600)  # the pair: only the curve is wrong
    elif case == "a key encrypted with a password":
        write_atomically(files.key, encrypted(files.key), 0o600)  # the certificate's own key
    elif case == "a key that is not PEM":
        write_atomically(files.key, b"not a key\n", 0o600)
    else:
        write_atomically(files.ca, b"not a bundle\n", 0o644)


@pytest.mark.parametrize("case", UNUSABLE)
def test_unusable_files_are_named_at_start_up(pki: Pki, tmp_path: Path, case: str) -> None:
    files = mine(pki, tmp_path / "mine")
    make_unusable(case, files, pki)
    with pytest.raises(HandshakeFailed) as caught:
        ZtateClient.from_files("localhost:1", cert=files.cert, key=files.key, ca=files.ca)
    reason, hint = UNUSABLE[case]
    assert (caught.value.code, caught.value.reason, caught.value.hint) == (
        grpc.StatusCode.UNAVAILABLE,
        reason,
        hint,
    )
    assert str(caught.value) == f"{reason}: {hint}"
    # no traceback of cryptography's behind it, and nothing of the files in it
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__
    for path in (files.cert, files.key, files.ca):
        for line in path.read_bytes().decode("ascii", "replace").splitlines():
            if len(line) > 8:
                assert line not in str(caught.value)


@pytest_asyncio.fixture
async def service(pki: Pki) -> AsyncIterator[tuple[Scripted, str]]:
    async with scripted_server(pki) as running:
        yield running


@pytest.mark.parametrize("case", UNUSABLE)
async def test_unusable_files_rotated_in_are_skipped_and_not_parsed_again(
    pki: Pki,
    tmp_path: Path,
    service: tuple[Scripted, str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    """The client keeps its channel (the calls succeed on the old files), parses the
    unusable files once, and takes the next usable files when they come."""
    servicer, target = service
    files = mine(pki, tmp_path / "mine")
    parses: list[bytes] = []
    matching = credentials_module._matching

    def counted(pems: credentials_module.Pems) -> bool:
        parses.append(pems.key)
        return matching(pems)

    monkeypatch.setattr(credentials_module, "_matching", counted)
    async with ZtateClient.from_files(
        target, cert=files.cert, key=files.key, ca=files.ca, retries=0
    ) as worker:
        first = worker._connection
        assert (await worker.get_view("order-42")).version == 0
        make_unusable(case, files, pki)
        for _ in range(3):
            assert (await worker.get_view("order-42")).version == 0
        assert len(parses) == 1  # parsed once, then skipped until the files change
        assert worker._connection is first  # the old channel serves on
        assert servicer.view_calls == 4
        # usable files again (another certificate of the CA, with its key): taken
        other = pki.node("planner")
        for source, path, mode in (
            (other.ca, files.ca, 0o644),
            (other.key, files.key, 0o600),
            (other.cert, files.cert, 0o644),
        ):
            write_atomically(path, source.read_bytes(), mode)
        assert (await worker.get_view("order-42")).version == 0
        assert worker._connection is not first
        assert worker._connection.pems.cert == other.cert.read_bytes()
        assert servicer.view_calls == 5


async def test_a_ca_of_an_unsupported_curve_does_not_break_the_diagnosis(
    pki: Pki, tmp_path: Path, service: tuple[Scripted, str]
) -> None:
    """A CA file holding a certificate with a key on secp112r1, named as the issuer of
    our certificate (so that its key is read), is usable at start-up (the bundle
    parses). When the service refuses our certificate, the diagnosis asks whether a
    CA of the CA file issued it: that certificate is skipped as one whose signature
    does not verify is, and the hint names our certificate's issuer: not cryptography's
    UnsupportedAlgorithm (failed before with it). Our certificate file holds its chain
    (ours and its CA's), as a worker behind an intermediate CA sends it: so TLS takes
    that chain and does not look in the CA file for our issuer (it would find the
    secp112r1 certificate and refuse its key as too small before any diagnosis)."""
    servicer, target = service
    # a CA of another name than the service's (else the secp112r1 certificate would be
    # taken for the issuer of the service's certificate too): the service refuses ours
    other_ca = tmp_path / "other-ca"
    ca.init_ca(other_ca, "other.example")
    ours = ca.issue(other_ca, Identity("other.example", Role.NODE, "db-writer"), tmp_path / "ours")
    chain = tmp_path / "chain.crt"
    chain.write_bytes(ours.cert.read_bytes() + (other_ca / ca.CA_CERT).read_bytes())
    issuer = x509.load_pem_x509_certificate(ours.cert.read_bytes()).issuer
    (name,) = issuer.get_attributes_for_oid(NameOID.COMMON_NAME)
    _, spki = secp112r1_key_pair()
    bundle = tmp_path / "ca.crt"
    # the secp112r1 certificate, then the service's CA (so that we trust the service)
    bundle.write_bytes(
        certificate_for(spki, pki, common_name=str(name.value))
        + pki.node("db-writer").ca.read_bytes()
    )
    async with ZtateClient.from_files(
        target, cert=chain, key=ours.key, ca=bundle, retries=0
    ) as worker:
        with pytest.raises(HandshakeFailed) as caught:
            await worker.get_view("order-42")
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert caught.value.reason == "CERTIFICATE_REFUSED"
    assert caught.value.hint.startswith("the service refused our certificate (")
    assert caught.value.hint.endswith(
        "the client certificate is not issued by the CA file's CA (its issuer is "
        f"{issuer.rfc4514_string()}): the service trusts only certificates of its own CA"
    )
    assert servicer.view_calls == 0  # refused in the handshake: no call reached it


async def test_a_certificate_path_that_became_a_symlink_loop_keeps_the_old_channel(
    pki: Pki, tmp_path: Path, service: tuple[Scripted, str]
) -> None:
    """A rotation swaps symlinks (as a Kubernetes secret volume does); caught between two
    swaps, or in a folder the worker may no longer search, a path cannot even be
    looked at (ELOOP, EACCES). That is a file not usable now, like a missing one: the
    old channel serves on. Before, only a missing file was, and every call raised
    OSError."""
    servicer, target = service
    files = mine(pki, tmp_path / "mine")
    async with ZtateClient.from_files(
        target, cert=files.cert, key=files.key, ca=files.ca, retries=0
    ) as worker:
        first = worker._connection
        assert (await worker.get_view("order-42")).version == 0
        files.cert.unlink()
        files.cert.symlink_to(files.cert)  # a loop: os.stat raises ELOOP
        for _ in range(2):
            assert (await worker.get_view("order-42")).version == 0
        assert worker._connection is first
        assert servicer.view_calls == 3
