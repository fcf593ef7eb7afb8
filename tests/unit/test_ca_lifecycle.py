"""The development CA's lifetimes and renewal, and files that are read again when they
change (the services' ``reloading`` and the SDK's copy), without a server."""

from __future__ import annotations

import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ztate.contract.files import FileTooLarge
from ztate.services.cli import ca
from ztate.services.cli.devsetup import renew_near_expiry
from ztate.services.cli.main import main as ztate
from ztate.services.runtime import tls
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.reloading import WatchedFiles, write_atomically
from ztate.worker_sdk._credentials import CertificateFiles

DOMAIN = "ztate.test"
PLANNER = Identity(DOMAIN, Role.NODE, "planner")


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    ca.init_ca(tmp_path / "ca", DOMAIN)
    return tmp_path / "ca"


def read(cert: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(cert.read_bytes())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90m", timedelta(minutes=90)),
        ("24h", timedelta(hours=24)),
        ("7d", timedelta(days=7)),
        (" 1d ", timedelta(days=1)),
    ],
)
def test_a_lifetime_is_minutes_hours_or_days(text: str, expected: timedelta) -> None:
    assert ca.parse_ttl(text) == expected


@pytest.mark.parametrize("text", ["1w", "0h", "", "90", "-1d", "1.5h", "3651d", "7 d", "1D"])
def test_any_other_lifetime_is_refused_with_the_rule(text: str) -> None:
    with pytest.raises(ValueError, match=r"(90m, 24h or 7d|at most 3650 days)"):
        ca.parse_ttl(text)


def test_the_cli_refuses_a_malformed_ttl_and_writes_nothing(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "certs"
    code = ztate(["ca", "issue", "--role", "node", "--name", "planner", "--ca-dir", str(ca_dir),
                  "--out", str(out), "--ttl", "1w"])  # fmt: skip
    assert code == 2  # a usage error
    assert capsys.readouterr().err == (
        "ztate: --ttl: a lifetime is a whole number of minutes, hours or days, "
        "as 90m, 24h or 7d, not '1w'\n"
    )
    assert not out.exists()


def test_certificates_live_a_day_unless_asked(ca_dir: Path, tmp_path: Path) -> None:
    issued = read(ca.issue(ca_dir, PLANNER, tmp_path / "certs").cert)
    lifetime = issued.not_valid_after_utc - datetime.now(UTC)
    assert timedelta(hours=23, minutes=58) < lifetime <= timedelta(days=1)
    assert ztate(["ca", "issue", "--role", "node", "--name", "planner", "--ca-dir", str(ca_dir),
                  "--out", str(tmp_path / "short"), "--ttl", "90m"]) == 0  # fmt: skip
    short = read(tmp_path / "short" / "node-planner.crt")
    assert short.not_valid_after_utc - datetime.now(UTC) <= timedelta(minutes=90)


def test_renewal_is_the_same_identity_with_a_new_key_pair(ca_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "certs"
    server = Identity(DOMAIN, Role.SERVICE, "transition")
    paths = ca.issue(
        ca_dir, server, out, dns_names=("localhost",), ip_addresses=("127.0.0.1",),
        ttl=timedelta(hours=2),
    )  # fmt: skip
    before, old_key = ca.Issued.read(paths.cert), paths.key.read_bytes()
    assert ztate(["ca", "renew", "--cert", str(paths.cert), "--ca-dir", str(ca_dir)]) == 0
    after = ca.Issued.read(paths.cert)
    assert (after.uris, after.dns_names, after.ip_addresses, after.common_name) == (
        (server.spiffe_id,),
        ("localhost",),
        ("127.0.0.1",),
        "service/transition",
    )
    assert after.serial != before.serial
    assert paths.key.read_bytes() != old_key
    # the new key is the new certificate's (else KeyFileError, as a server would refuse it)
    tls.checked_files(paths.cert, paths.key, out / ca.CA_CERT)
    assert after.lifetime == before.lifetime == timedelta(hours=2)
    assert stat.S_IMODE(paths.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.cert.stat().st_mode) == 0o644
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "service-transition.crt",
                                                      "service-transition.key"]  # fmt: skip


def test_renewing_what_does_not_exist_says_so(ca_dir: Path, tmp_path: Path) -> None:
    assert ztate(["ca", "renew", "--role", "node", "--name", "nobody", "--out", str(tmp_path),
                  "--ca-dir", str(ca_dir)]) == 1  # fmt: skip
    assert ztate(["ca", "renew", "--name", "nobody"]) == 2  # --role missing


def test_issuing_from_a_new_ca_adds_it_to_the_bundle_beside(ca_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "certs"
    ca.issue(ca_dir, PLANNER, out)
    ca.init_ca(tmp_path / "new-ca", DOMAIN)
    ca.issue(tmp_path / "new-ca", PLANNER, out)
    held = x509.load_pem_x509_certificates((out / ca.CA_CERT).read_bytes())
    assert held == [read(ca_dir / ca.CA_CERT), read(tmp_path / "new-ca" / ca.CA_CERT)]
    ca.issue(tmp_path / "new-ca", Identity(DOMAIN, Role.NODE, "db-writer"), out)
    assert len(x509.load_pem_x509_certificates((out / ca.CA_CERT).read_bytes())) == 2


def test_the_development_layout_renews_what_is_near_expiry(ca_dir: Path, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    now = datetime.now(UTC)
    old = ca.issue(ca_dir, PLANNER, certs, not_before=now - timedelta(hours=20),
                   not_after=now + timedelta(hours=4))  # fmt: skip
    fresh = ca.issue(ca_dir, Identity(DOMAIN, Role.NODE, "db-writer"), certs)
    fresh_serial, old_serial = ca.Issued.read(fresh.cert).serial, ca.Issued.read(old.cert).serial
    assert renew_near_expiry(ca_dir, certs) == [old.cert]
    assert ca.Issued.read(old.cert).serial != old_serial
    assert not ca.Issued.read(old.cert).near_expiry()
    assert ca.Issued.read(fresh.cert).serial == fresh_serial
    assert renew_near_expiry(ca_dir, certs) == []


ADMIN = Identity(DOMAIN, Role.OPERATOR, "admin")


def forged_certificate(folder: Path, stem: str, signer: ec.EllipticCurvePrivateKey | None) -> Path:
    """A certificate naming the operator identity ``ADMIN``, near expiry, signed with
    ``signer`` (its own key when None: self-signed), and its key, as anyone who can write
    into the certificate folder could leave them there."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, stem)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(read(folder.parent / "ca" / ca.CA_CERT).subject)  # the CA's name, too
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=23))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(ADMIN.spiffe_id)]),
            critical=False,
        )
        .sign(signer or key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (folder / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return folder / f"{stem}.crt"


@pytest.mark.parametrize("signer", ["self-signed", "another-ca", "a-ca-added-beside-it"])
def test_renewing_a_certificate_the_ca_did_not_issue_is_refused_and_changes_nothing(
    ca_dir: Path, tmp_path: Path, signer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Renewal copies a certificate's identities into a new one the CA signs: a
    certificate someone wrote into the folder with their own key (or another CA's),
    naming the operator identity, became a genuine operator certificate. Also when
    they added their CA to the ``ca.crt`` beside it, which they can write as well."""
    other = None
    certs = tmp_path / "certs"
    if signer != "self-signed":
        ca.init_ca(tmp_path / "other-ca", DOMAIN)
        other = serialization.load_pem_private_key(
            (tmp_path / "other-ca" / ca.CA_KEY).read_bytes(), password=None
        )
        assert isinstance(other, ec.EllipticCurvePrivateKey)
    if signer == "a-ca-added-beside-it":
        ca.issue(ca_dir, PLANNER, certs)  # a genuine folder: the CA's ca.crt beside
        with (certs / ca.CA_CERT).open("ab") as bundle:
            bundle.write((tmp_path / "other-ca" / ca.CA_CERT).read_bytes())
    forged = forged_certificate(certs, "operator-admin", other)
    before = {p.name: p.read_bytes() for p in certs.iterdir()}

    code = ztate(["ca", "renew", "--cert", str(forged), "--ca-dir", str(ca_dir)])

    assert code == 1
    assert capsys.readouterr().err == (
        f"ztate: cannot renew: {forged} was not issued by the CA in {ca_dir}: not renewed "
        "(issue the identity with ztate ca issue, or name its CA with --previous-ca during a "
        "CA rotation)\n"
    )
    assert {p.name: p.read_bytes() for p in certs.iterdir()} == before


def test_the_development_renewal_skips_a_foreign_certificate_and_renews_the_rest(
    ca_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``ztate run`` renews every certificate of its folder near expiry: a forged one is
    left as it is (logged by name), a file that is no certificate too, and its own are
    still renewed."""
    certs = tmp_path / "certs"
    now = datetime.now(UTC)
    own = ca.issue(ca_dir, PLANNER, certs, not_before=now - timedelta(hours=20),
                   not_after=now + timedelta(hours=4))  # fmt: skip
    own_serial = ca.Issued.read(own.cert).serial
    forged = forged_certificate(certs, "operator-admin", None)
    forged_bytes = forged.read_bytes()
    (certs / "broken.crt").write_bytes(b"not a certificate")
    (certs / "broken.key").write_bytes(b"")

    with caplog.at_level("WARNING", logger="ztate.services.cli.devsetup"):
        assert renew_near_expiry(ca_dir, certs) == [own.cert]

    assert ca.Issued.read(own.cert).serial != own_serial
    assert forged.read_bytes() == forged_bytes
    assert [r.getMessage() for r in caplog.records] == [
        "cannot renew broken.crt (ValueError)",
        "operator-admin.crt was not issued by this CA: not renewed",
    ]


def test_watched_files_rebuild_on_change_and_keep_the_last_good_value(tmp_path: Path) -> None:
    path = tmp_path / "value"
    write_atomically(path, b"1", 0o644)
    builds: list[bytes] = []  # every build tried, the failed ones too

    def build() -> int:
        builds.append(path.read_bytes())
        return int(builds[-1])

    files = WatchedFiles("a number", (path,), build)
    assert (files.current(), files.current(), builds) == (1, 1, [b"1"])  # unchanged: not read
    write_atomically(path, b"2", 0o644)
    assert files.current() == 2
    write_atomically(path, b"not a number", 0o644)
    assert (files.refresh(), files.value) == (False, 2)
    # a file that failed is not read and parsed again at every call (a 16 MiB revocation
    # list was, at every RPC), only once it changes
    for _ in range(3):
        assert (files.refresh(), files.current()) == (False, 2)
    assert builds == [b"1", b"2", b"not a number"]
    write_atomically(path, b"3", 0o644)
    assert files.current() == 3


def test_watched_files_keep_their_value_while_a_file_is_a_symlink_loop(tmp_path: Path) -> None:
    """A file that becomes a symlink loop (stat: ELOOP) is a file that cannot be read:
    the last good value stays, nothing raises, and the file back is taken."""
    path, other = tmp_path / "value", tmp_path / "other"
    write_atomically(path, b"1", 0o644)
    files = WatchedFiles("a number", (path,), lambda: int(path.read_bytes()))
    path.unlink()
    path.symlink_to(other)
    other.symlink_to(path)
    assert (files.refresh(), files.value) == (False, 1)
    path.unlink()
    write_atomically(path, b"2", 0o644)
    assert (files.refresh(), files.value) == (True, 2)


def test_a_server_does_not_start_on_a_certificate_without_its_key(
    ca_dir: Path, tmp_path: Path
) -> None:
    one = ca.issue(ca_dir, PLANNER, tmp_path / "one")
    two = ca.issue(ca_dir, PLANNER, tmp_path / "two")
    with pytest.raises(ValueError, match="is not the key of"):
        tls.server_credentials(one.cert, two.key, one.ca_cert)


def test_the_sdk_takes_new_files_only_once_they_match(ca_dir: Path, tmp_path: Path) -> None:
    mine = ca.issue(ca_dir, PLANNER, tmp_path / "mine")
    files = CertificateFiles(mine.cert, mine.key, mine.ca_cert)
    assert files.changed() is None
    other = ca.issue(ca_dir, PLANNER, tmp_path / "other")
    write_atomically(mine.cert, other.cert.read_bytes(), 0o644)
    assert files.changed() is None  # the new certificate without its key
    write_atomically(mine.key, other.key.read_bytes(), 0o600)
    taken = files.changed()
    assert taken is not None
    assert (taken.cert, taken.key) == (other.cert.read_bytes(), other.key.read_bytes())
    assert files.changed() is None


def _endless(path: Path) -> None:
    """``path`` becomes a link to /dev/zero: a file that never ends (a swapped symlink)."""
    link = path.with_name(path.name + ".zero")
    link.symlink_to("/dev/zero")
    link.replace(path)


@pytest.mark.parametrize("which", ["cert", "key", "ca_cert"])
def test_a_credential_file_is_read_to_a_bound_by_services_and_the_sdk(
    ca_dir: Path, tmp_path: Path, which: str
) -> None:
    """A certificate, key or CA bundle that never ends is refused at its bound (1 MiB,
    4 MiB for a bundle), naming the file, by the services and by a starting worker; a
    running worker keeps its files and does not read it again until it changes."""
    mine = ca.issue(ca_dir, PLANNER, tmp_path / "mine")
    running = CertificateFiles(mine.cert, mine.key, mine.ca_cert)
    before = running.pems
    endless = getattr(mine, which)
    _endless(endless)
    kind = {"cert": "a certificate", "key": "a private key", "ca_cert": "a CA bundle"}[which]
    said = f"{endless}: more than .* bytes, too large for {kind}"
    with pytest.raises(FileTooLarge, match=said):
        tls.checked_files(mine.cert, mine.key, mine.ca_cert)
    with pytest.raises(FileTooLarge, match=said):
        CertificateFiles(mine.cert, mine.key, mine.ca_cert)
    assert running.changed() is None
    assert running.pems == before


def test_a_ca_key_encrypted_with_a_password_is_one_line_and_issues_nothing(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a TypeError traceback from cryptography."""
    key = serialization.load_pem_private_key((ca_dir / ca.CA_KEY).read_bytes(), password=None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"a passphrase"),
    )
    (ca_dir / ca.CA_KEY).write_bytes(encrypted)
    out = tmp_path / "out"
    argv = ["ca", "issue", "--ca-dir", str(ca_dir), "--role", "node", "--name", "planner"]
    assert ztate([*argv, "--out", str(out), "--trust-domain", DOMAIN]) == 1
    assert capsys.readouterr().err == (
        f"ztate: cannot issue: {ca_dir / ca.CA_KEY} is encrypted with a password: "
        "ztate reads private keys without one\n"
    )
    assert not out.exists()


def test_a_ca_folder_that_cannot_be_made_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a FileNotFoundError (or NotADirectoryError) traceback."""
    (tmp_path / "a-file").write_text("")
    folder = tmp_path / "a-file" / "ca"
    assert ztate(["ca", "init", "--dir", str(folder), "--trust-domain", DOMAIN]) == 1
    assert capsys.readouterr().err == f"ztate: cannot create the CA in {folder}: Not a directory\n"


def test_a_rotation_renews_the_old_cas_certificates_only_when_the_operator_names_it(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """During a CA rotation the new CA renews what the old one issued: the old CA is
    named on the command line (--previous-ca), never taken from the folder of the
    certificate, which whoever planted a certificate there could write too."""
    new_ca = tmp_path / "new-ca"
    ca.init_ca(new_ca, DOMAIN)
    old = ca.issue(ca_dir, PLANNER, tmp_path / "certs")
    argv = ["ca", "renew", "--cert", str(old.cert), "--ca-dir", str(new_ca)]
    assert ztate(argv) == 1
    assert "not issued by the CA in" in capsys.readouterr().err
    assert ztate([*argv, "--previous-ca", str(ca_dir)]) == 0
    renewed = x509.load_pem_x509_certificate(old.cert.read_bytes())
    new_cert = x509.load_pem_x509_certificate((new_ca / ca.CA_CERT).read_bytes())
    renewed.verify_directly_issued_by(new_cert)  # raises if another CA signed it


@pytest.mark.parametrize("previous", ["missing", "dev-zero", "not-pem"])
def test_a_previous_ca_that_cannot_be_read_renews_nothing_in_one_line(
    ca_dir: Path, tmp_path: Path, previous: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--previous-ca`` names a file or folder of the operator's: one that is missing,
    endless or no certificate is one line, exit 1, and the certificate is left as it is."""
    issued = ca.issue(ca_dir, PLANNER, tmp_path / "certs")
    path = tmp_path / "previous.crt"
    if previous == "dev-zero":
        path.symlink_to("/dev/zero")
    elif previous == "not-pem":
        path.write_text("not a certificate")
    before = {p.name: p.read_bytes() for p in (tmp_path / "certs").iterdir()}
    argv = ["ca", "renew", "--cert", str(issued.cert), "--ca-dir", str(ca_dir)]
    assert ztate([*argv, "--previous-ca", str(path)]) == 1
    err = capsys.readouterr().err
    said = {
        "missing": "No such file or directory",
        "dev-zero": "too large for a CA bundle",
        "not-pem": "ztate: cannot renew: ",
    }[previous]
    assert said in err
    assert err.startswith("ztate: cannot renew: ")
    assert err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "certs").iterdir()} == before
