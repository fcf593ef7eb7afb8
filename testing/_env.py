"""``ZtateEnvironment``: a real, throw-away control plane for one test or one session."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from ztate.contract.keyring import Keyring, generate_keyring_file, generate_signing_key
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Role
from ztate.testing._approval import deliver_approval
from ztate.testing._ledger import Ledger, with_database
from ztate.testing._pki import TRUST_DOMAIN, Credentials, Pki
from ztate.transition_service.app import RunningService, start
from ztate.worker_sdk import AwaitingApproval, SyncZtateClient, Transition, ZtateClient

PolicySource = Path | str | Mapping[str, Any]


def _default_pipeline() -> Path:
    from importlib.resources import files

    return Path(str(files("ztate.services.defaults").joinpath("policy.yaml")))


def write_policies(sources: PolicySource | Iterable[PolicySource], folder: Path) -> Path:
    """Copy or write each policy (a path to a file or a folder, or a policy document as a
    mapping) into ``folder``, which the service then loads as one policy set."""
    folder.mkdir(parents=True, exist_ok=True)
    items: list[PolicySource] = (
        [sources] if isinstance(sources, (Path, str, Mapping)) else list(sources)
    )
    for index, source in enumerate(items):
        if isinstance(source, Mapping):
            (folder / f"policy-{index}.json").write_text(json.dumps(source))
            continue
        path = Path(source)
        if path.is_dir():
            for child in sorted(path.iterdir()):
                if child.suffix in {".yaml", ".yml", ".json"}:
                    shutil.copyfile(child, folder / f"{index}-{child.name}")
        else:
            shutil.copyfile(path, folder / f"{index}-{path.name}")
    return folder


async def create_database(server_dsn: str) -> str:
    """A new, empty database on a Postgres server (a superuser DSN)."""
    name = f"ztate_env_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return with_database(server_dsn, name)


async def drop_database(server_dsn: str, dsn: str) -> None:
    name = urlsplit(dsn).path.lstrip("/")
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@dataclass
class ZtateEnvironment:
    """A running control plane: where it listens, its PKI, its database and keys.

    Start one with ``async with ZtateEnvironment.start(policy) as env:``. Clients it
    hands out are closed when it exits.
    """

    target: str
    pki: Pki
    database_dsn: str
    keyring: Keyring
    home: Path
    approval_signing_key: Path
    service: RunningService
    ledger: Ledger
    _clients: list[ZtateClient] = field(default_factory=list, repr=False)
    _sync_clients: list[SyncZtateClient] = field(default_factory=list, repr=False)

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls,
        policy: PolicySource | Iterable[PolicySource] | None = None,
        *,
        postgres_dsn: str | None = None,
        max_patch_bytes: int = 64 * 1024,
        max_state_bytes: int = 1024 * 1024,
        **settings: Any,
    ) -> AsyncIterator[ZtateEnvironment]:
        """Start a control plane loading ``policy`` (default: the four-node pipeline of
        docs/policy.md); one policy or several, each a file, a folder or a mapping.

        ``postgres_dsn`` is a superuser DSN of a Postgres server on which a fresh database
        is created and dropped afterwards; without it, ``ZTATE_TEST_DATABASE_URL`` if
        set, else an embedded server in a temporary folder, stopped on exit. Other
        keyword arguments are ``Settings`` fields (``watch_max_streams=...``).
        """
        with tempfile.TemporaryDirectory(prefix="ztate-env-") as temporary:
            root = Path(temporary)
            embedded: Any = None
            server_dsn = postgres_dsn or os.environ.get("ZTATE_TEST_DATABASE_URL")
            if server_dsn is None:
                from ztate.services.store.embedded import start_embedded_postgres

                server_dsn, embedded = start_embedded_postgres(root / "pg")
            try:
                async with cls._on(
                    root, server_dsn, policy, max_patch_bytes, max_state_bytes, settings
                ) as env:
                    yield env
            finally:
                if embedded is not None:
                    embedded.cleanup()

    @classmethod
    @contextlib.asynccontextmanager
    async def _on(
        cls,
        root: Path,
        server_dsn: str,
        policy: PolicySource | Iterable[PolicySource] | None,
        max_patch_bytes: int,
        max_state_bytes: int,
        extra: dict[str, Any],
    ) -> AsyncIterator[ZtateEnvironment]:
        pki = Pki(root / "pki")
        keyring_file = root / "keys" / "hmac-keyring.json"
        keyring_file.parent.mkdir(parents=True)
        generate_keyring_file(keyring_file, "test-k1")
        signing_key, public_keys = root / "keys" / "approval.pem", root / "keys" / "approval.json"
        generate_signing_key(signing_key, public_keys, "approval-k1")
        policies = write_policies(
            policy if policy is not None else _default_pipeline(), root / "policies"
        )
        settings = Settings(
            home=root / "home",
            listen="127.0.0.1:0",
            trust_domain=TRUST_DOMAIN,
            tls_cert=pki.certs / "service-transition.crt",
            tls_key=pki.certs / "service-transition.key",
            tls_ca=pki.certs / "ca.crt",
            policy_path=policies,
            hmac_keyring_file=keyring_file,
            approval_public_keys_file=public_keys,
            max_patch_bytes=max_patch_bytes,
            max_state_bytes=max_state_bytes,
            db_pool_size=extra.pop("db_pool_size", 4),
            **extra,
        )
        dsn = await create_database(server_dsn)
        keyring = Keyring.load(keyring_file, None)
        try:
            service = await start(settings, dsn=dsn)
            env = cls(
                target=f"localhost:{service.port}",
                pki=pki,
                database_dsn=dsn,
                keyring=keyring,
                home=root,
                approval_signing_key=signing_key,
                service=service,
                ledger=Ledger(dsn, keyring),
            )
            try:
                yield env
            finally:
                await env._close_clients()
                await service.stop(grace=1.0)
        finally:
            await drop_database(server_dsn, dsn)

    async def _close_clients(self) -> None:
        for sync in self._sync_clients:
            sync.close()
        for opened in self._clients:
            await opened.close()

    def credentials(self, role: Role | str, name: str) -> Credentials:
        """Certificate, key and CA of ``role``/``name`` (issued on first use)."""
        return self.pki.identity(Role(role), name)

    def client(
        self, node: str, *, role: Role | str = Role.NODE, timeout: float = 10.0
    ) -> ZtateClient:
        """An asyncio client holding ``node``'s own certificate (role ``node`` unless
        ``role`` says otherwise); closed when the environment exits."""
        creds = self.credentials(role, node)
        opened = ZtateClient.from_files(
            self.target, cert=creds.cert, key=creds.key, ca=creds.ca, timeout=timeout
        )
        self._clients.append(opened)
        return opened

    def operator(self, name: str = "admin") -> ZtateClient:
        """An operator's client: operators create threads and read every record."""
        return self.client(name, role=Role.OPERATOR)

    def sync_client(self, node: str, *, role: Role | str = Role.NODE) -> SyncZtateClient:
        """A blocking client for ``node``; use it from a thread other than the event
        loop's (``asyncio.to_thread``) or from synchronous code."""
        creds = self.credentials(role, node)
        opened = SyncZtateClient.from_files(
            self.target, cert=creds.cert, key=creds.key, ca=creds.ca
        )
        self._sync_clients.append(opened)
        return opened

    async def create_thread(
        self,
        thread_id: str | None = None,
        initial_state: Mapping[str, Any] | None = None,
        *,
        policy: str = "",
    ) -> Transition:
        """Create a thread as the operator ``admin`` (a fresh id unless one is given)."""
        async with self._operator_once() as operator:
            return await operator.create_thread(
                thread_id or f"t-{uuid.uuid4().hex[:16]}", dict(initial_state or {}), policy=policy
            )

    @contextlib.asynccontextmanager
    async def _operator_once(self) -> AsyncIterator[ZtateClient]:
        creds = self.credentials(Role.OPERATOR, "admin")
        async with ZtateClient.from_files(
            self.target, cert=creds.cert, key=creds.key, ca=creds.ca
        ) as operator:
            yield operator

    async def approve(self, parked: AwaitingApproval) -> Transition:
        """Approve a parked proposal as the approval service would (a signed receipt
        from reviewer ``alice``); returns the committed transition."""
        thread_id, key = parked.handle.split("/", 1)
        conn = await asyncpg.connect(self.database_dsn)
        try:
            digest = await conn.fetchval(
                "SELECT digest FROM ztate.pending_transitions "
                "WHERE thread_id = $1 AND idempotency_key = $2",
                thread_id,
                key,
            )
        finally:
            await conn.close()
        if digest is None:
            raise LookupError(f"no parked proposal {parked.handle!r}")
        applied = await deliver_approval(
            self.target,
            self.pki,
            self.approval_signing_key,
            digest,
            thread_id,
            parked.base_version,
        )
        return Transition.from_message(applied.transition)
