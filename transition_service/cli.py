"""``ztate run`` and ``ztate serve``: the transition service's commands.

Registered under the ``ztate.cli`` entry-point group (pyproject.toml), so that the
core's ``ztate`` command finds them without importing the server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from pydantic import SecretStr

from ztate.contract.errors import KeyFileError, KeyringError
from ztate.services.cli.main import Subparsers, settings_or_exit
from ztate.services.policy.model import PolicyError
from ztate.services.runtime.config import ApprovalSettings, Settings
from ztate.services.runtime.revocation import RevocationListError
from ztate.services.runtime.telemetry import configure_logging
from ztate.services.store.migrate import MigrationError
from ztate.transition_service.workers import WORKER_FLAG, default_workers, supervise

log = logging.getLogger("ztate.run")


def register(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``run`` and ``serve`` to the ``ztate`` command."""
    subparsers.add_parser(
        "run", help="development: set up .ztate/ on first run, then serve"
    ).set_defaults(func=cmd_run)
    serve = subparsers.add_parser("serve", help="serve from configuration only")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="processes sharing the listening port, one per core at most (default 1; 0: one "
        "per core); needs DATABASE_URL",
    )
    serve.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)


def _serve(settings: Settings, *, share_port: bool = False) -> int:
    from ztate.transition_service.app import serve

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(settings, share_port=share_port))
    except (
        PolicyError,
        KeyringError,
        KeyFileError,
        MigrationError,
        RevocationListError,
        FileNotFoundError,
    ) as exc:
        print(f"ztate: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


def _start_approval_process(settings: Settings, dsn: str) -> subprocess.Popen[bytes]:
    """The approval service, as its own process, on the same (embedded) database."""
    env = dict(os.environ, DATABASE_URL=dsn, ZTATE_HOME=str(settings.home))
    env.setdefault("ZTATE_APPROVAL_TRANSITION_TARGET", settings.listen)
    ztate = Path(sys.executable).with_name("ztate")
    return subprocess.Popen([str(ztate), "approval-serve"], env=env)


def cmd_run(_: argparse.Namespace) -> int:
    """Development: create what is missing under .ztate/, then run both services."""
    from ztate.services.cli.devsetup import OPERATOR_NAME, REVIEWERS, ensure_dev_layout
    from ztate.services.store.embedded import start_embedded_postgres

    settings = settings_or_exit()
    configure_logging(settings.log_format)
    layout = ensure_dev_layout(settings)
    approval = ApprovalSettings(home=settings.home, trust_domain=settings.trust_domain)
    database = (
        "DATABASE_URL" if settings.database_url else f"embedded Postgres in {settings.home / 'pg'}"
    )
    if settings.database_url is None:
        dsn, _embedded = start_embedded_postgres(settings.home / "pg")
    else:
        dsn = settings.database_url.get_secret_value()
    settings = settings.model_copy(
        update={
            "database_url": SecretStr(dsn),
            "approval_target": settings.approval_target or f"localhost:{_port(approval.listen)}",
        }
    )
    certs = layout.certs.resolve()

    nodes = ", ".join(
        sorted(n for p in layout.policies.policies.values() for n in p.document.nodes)
    )
    policies = ", ".join(
        f"{p.name} (digest {p.digest[:16]}...)" for p in layout.policies.policies.values()
    )
    print(
        f"""ztate control plane
  transition    {settings.listen} (mTLS, trust domain {settings.trust_domain})
  approval      {approval.listen} (its own process; reviewers: {", ".join(REVIEWERS)})
  database      {database}
  policy        {settings.policy_path}: {policies}
  certificates  {certs}/  (ca.crt, operator-{OPERATOR_NAME}.*, reviewer-<name>.*,
                node-<name>.* for: {nodes})
  CA key        {layout.ca_dir.resolve()}/ca.key (never give it to a service or a worker)

Connect a worker:
  from ztate.worker_sdk import ZtateClient
  client = ZtateClient.from_files("{settings.listen}", cert="{certs}/node-input-parser.crt",
                                  key="{certs}/node-input-parser.key", ca="{certs}/ca.crt")
""",
        flush=True,
    )
    approval_process = _start_approval_process(settings, dsn)
    renewing = _renew_while_running(layout.ca_dir, layout.certs)
    try:
        return _serve(settings)
    finally:
        renewing.set()
        approval_process.terminate()
        approval_process.wait(timeout=30)


def _renew_while_running(ca_dir: Path, certs: Path) -> threading.Event:
    """Development certificates live a day: renew them while ``ztate run`` runs (both
    services reload their files). Set the returned event to stop."""
    from ztate.services.cli.devsetup import RENEW_INTERVAL_SECONDS, renew_near_expiry

    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(RENEW_INTERVAL_SECONDS):
            for cert in renew_near_expiry(ca_dir, certs):
                log.info("renewed development certificate %s", cert.name)

    threading.Thread(target=renew, name="ztate-dev-renewal", daemon=True).start()
    return stop


def _port(listen: str) -> str:
    return listen.rsplit(":", 1)[1]


def cmd_serve(args: argparse.Namespace) -> int:
    """Production: serve from configuration only; create nothing. With ``--workers N``,
    N processes on one port (``ztate.transition_service.workers``)."""
    settings = settings_or_exit()
    configure_logging(settings.log_format)
    if args.worker_of_group:
        return _serve(settings, share_port=True)
    workers = args.workers if args.workers > 0 else default_workers()
    if workers < 0 or args.workers < 0:
        print("ztate: --workers must be 0 (one per core) or more", file=sys.stderr)
        return 2
    if workers == 1:
        return _serve(settings)
    if settings.database_url is None:
        print(
            "ztate: --workers needs DATABASE_URL (each worker would start its own embedded "
            "Postgres)",
            file=sys.stderr,
        )
        return 2
    return supervise(workers, settings.listen)
