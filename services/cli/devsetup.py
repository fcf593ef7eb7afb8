"""First-run set-up for development: CA, certificates, HMAC keyring and policy.

Everything lands under ``ZTATE_HOME`` (``.ztate/`` by default). Existing files
are kept, so a second run reuses the same identities, keys and data; certificates
(short-lived: a day) past two thirds of their lifetime are renewed with a new key pair.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ztate.contract.keyring import generate_keyring_file, generate_signing_key
from ztate.services.cli import ca
from ztate.services.policy.model import PolicySet
from ztate.services.runtime.config import ApprovalSettings, Settings
from ztate.services.runtime.identity import Identity, Role

log = logging.getLogger(__name__)

OPERATOR_NAME = "admin"
REVIEWERS = ("alice", "bob")


@dataclass(frozen=True)
class DevLayout:
    ca_dir: Path
    certs: Path
    policies: PolicySet


def ensure_dev_layout(settings: Settings) -> DevLayout:
    """Create whatever of the development layout is missing."""
    home = settings.home
    ca_dir, certs = home / "ca", home / "certs"
    assert settings.policy_path is not None
    assert settings.hmac_keyring_file is not None
    if not settings.policy_path.exists():
        settings.policy_path.parent.mkdir(parents=True, exist_ok=True)
        source = resources.files("ztate.services.defaults").joinpath("policy.yaml")
        with resources.as_file(source) as path:
            shutil.copyfile(path, settings.policy_path)
    policies = PolicySet.load(settings.policy_path)
    if not (ca_dir / ca.CA_CERT).exists():
        ca.init_ca(ca_dir, settings.trust_domain)

    def issue(role: Role, name: str, **extra: tuple[str, ...]) -> None:
        identity = Identity(settings.trust_domain, role, name)
        if not (certs / f"{role}-{name}.crt").exists():
            ca.issue(ca_dir, identity, certs, **extra)  # type: ignore[arg-type]

    server_names = {"dns_names": ("localhost",), "ip_addresses": ("127.0.0.1",)}
    issue(Role.SERVICE, "transition", **server_names)
    issue(Role.SERVICE, "approval", **server_names)
    issue(Role.OPERATOR, OPERATOR_NAME)
    for reviewer in REVIEWERS:
        issue(Role.REVIEWER, reviewer)
    for policy in policies.policies.values():
        for node in policy.document.nodes:
            issue(Role.NODE, node)
    renew_near_expiry(ca_dir, certs)
    if settings.hmac_keyring is None and not settings.hmac_keyring_file.exists():
        generate_keyring_file(settings.hmac_keyring_file)
    assert settings.checkpoint_key_file is not None
    assert settings.checkpoint_public_keys_file is not None
    if not settings.checkpoint_key_file.exists():
        generate_signing_key(
            settings.checkpoint_key_file,
            settings.checkpoint_public_keys_file,
            settings.checkpoint_key_id,
        )
    approval = ApprovalSettings(home=home, trust_domain=settings.trust_domain)
    assert approval.signing_key_file is not None
    assert settings.approval_public_keys_file is not None
    if not approval.signing_key_file.exists():
        # The private key stays with the approval service; the transition service
        # gets only the public half.
        generate_signing_key(
            approval.signing_key_file, settings.approval_public_keys_file, approval.key_id
        )
    return DevLayout(ca_dir=ca_dir, certs=certs, policies=policies)


def renew_near_expiry(ca_dir: Path, certs: Path) -> list[Path]:
    """Renew (new key pair, files replaced atomically) every development certificate in
    ``certs`` past two thirds of its lifetime; ``ztate run`` calls it at start and every
    ``RENEW_INTERVAL`` while it runs, and the services and workers reload the files."""
    renewed = []
    for cert in sorted(certs.glob("*.crt")):
        if cert.name == ca.CA_CERT or not cert.with_suffix(".key").exists():
            continue
        try:
            if not ca.Issued.read(cert).near_expiry():
                continue
            ca.renew(ca_dir, cert)
        except ca.NotIssuedHere:  # someone else's file, never made genuine: left as it is
            log.warning("%s was not issued by this CA: not renewed", cert.name)
            continue
        except (OSError, ValueError) as failure:  # the others are still renewed
            log.warning("cannot renew %s (%s)", cert.name, type(failure).__name__)
            continue
        renewed.append(cert)
    return renewed


RENEW_INTERVAL_SECONDS = 600.0
