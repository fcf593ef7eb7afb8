"""``ztate run`` and ``ztate serve``: the transition service's commands.

Registered under the ``ztate.cli`` entry-point group (pyproject.toml), so that the
core's ``ztate`` command finds them without importing the server.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ztate.services.cli.main import Subparsers, settings_or_exit
from ztate.services.cli.output import USAGE, CliError, set_log_level

# More workers than cores only contend (one process uses one core), and each holds its
# own pools of database connections: past this, a typo (--workers 1000) would exhaust
# Postgres's connections rather than serve faster.
MAX_WORKERS = 64

if TYPE_CHECKING:
    import subprocess
    import threading

    from ztate.services.runtime.config import Settings


def register(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``run`` and ``serve`` to the ``ztate`` command."""
    from ztate.approval_service.cli import add_service_flags
    from ztate.services.cli.resources import bounded_int

    run = subparsers.add_parser(
        "run",
        help="development: set up $ZTATE_HOME on first run, then serve both services",
        description="Creates whatever is missing under $ZTATE_HOME (.ztate/): a CA, "
        "certificates, keys, the default policy and, without DATABASE_URL, an embedded "
        "Postgres (its log in $ZTATE_HOME/pg/log). Prints one banner; -v shows the "
        "services' and Postgres's logs as they come.",
    )
    run.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print the services' informational log lines and gRPC's own",
    )
    add_service_flags(run, log_level="warning")
    run.set_defaults(func=cmd_run)
    serve = subparsers.add_parser("serve", help="serve from configuration only")
    add_service_flags(serve)
    serve.add_argument(
        "--workers",
        type=bounded_int(0, MAX_WORKERS),
        default=1,
        metavar="N",
        help=f"processes sharing the listening port, one per core at most (default 1; 0: one "
        f"per core; at most {MAX_WORKERS}); needs DATABASE_URL",
    )
    serve.add_argument("--worker-of-group", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)


def _serve(settings: Settings, wait_seconds: float, *, share_port: bool = False) -> int:
    from ztate.services.cli.startup import run_service
    from ztate.transition_service.app import serve

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    dsn = settings.database_url.get_secret_value() if settings.database_url else None
    return run_service(
        lambda started: serve(settings, share_port=share_port, started=started),
        dsn=dsn,
        wait_seconds=wait_seconds,
        prefix="cannot start",
        stopped="the transition service stopped",
    )


def _start_approval_process(settings: Settings, dsn: str, verbose: bool) -> subprocess.Popen[bytes]:
    """The approval service, as its own process, on the same (embedded) database."""
    import subprocess

    env = dict(os.environ, DATABASE_URL=dsn, ZTATE_HOME=str(settings.home))
    env.setdefault("ZTATE_APPROVAL_TRANSITION_TARGET", settings.listen)
    ztate = Path(sys.executable).with_name("ztate")
    quiet = [] if verbose else ["--log-level", "warning"]
    return subprocess.Popen([str(ztate), "approval-serve", *quiet], env=env)


def cmd_run(args: argparse.Namespace) -> int:
    """Development: create what is missing under .ztate/, then run both services."""
    from pydantic import SecretStr

    from ztate.services.cli.devsetup import OPERATOR_NAME, REVIEWERS, ensure_dev_layout
    from ztate.services.runtime.config import ApprovalSettings
    from ztate.services.runtime.telemetry import configure_logging
    from ztate.services.store.embedded import start_embedded_postgres
    from ztate.transition_service.workers import port_is_free

    if not args.verbose:  # raw gRPC core lines: only with -v (GRPC_VERBOSITY overrides)
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    settings = settings_or_exit()
    configure_logging(settings.log_format)
    set_log_level("info" if args.verbose else args.log_level)
    approval = ApprovalSettings(home=settings.home, trust_domain=settings.trust_domain)
    for listen in (settings.listen, approval.listen):  # before anything starts: a
        if not port_is_free(listen):  # second `ztate run` says so in one line
            raise CliError(f"cannot start: {listen} is in use", USAGE)
    layout = ensure_dev_layout(settings)
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
    pg_logs = (
        f"Postgres in {settings.home.resolve()}/pg.log and pg/log"
        if database.startswith("embedded")
        else "Postgres: your server's"
    )

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

Explore from another shell (docs/cli.md):
  export ZTATE_HOME={settings.home.resolve()} ZTATE_LISTEN={settings.listen} \\
         ZTATE_APPROVAL_LISTEN={approval.listen}
  ztate ledger list; ztate approvals list; ztate context show
Logs: ztate run -v (services); {pg_logs}
""",
        flush=True,
    )
    approval_process = _start_approval_process(settings, dsn, args.verbose)
    renewing = _renew_while_running(layout.ca_dir, layout.certs)
    try:
        return _serve(settings, args.wait_for_database)
    finally:
        renewing.set()
        approval_process.terminate()
        approval_process.wait(timeout=30)


def _renew_while_running(ca_dir: Path, certs: Path) -> threading.Event:
    """Development certificates live a day: renew them while ``ztate run`` runs (both
    services reload their files). Set the returned event to stop."""
    import logging
    import threading

    from ztate.services.cli.devsetup import RENEW_INTERVAL_SECONDS, renew_near_expiry

    log = logging.getLogger("ztate.run")

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
    from ztate.services.runtime.telemetry import configure_logging
    from ztate.transition_service.workers import default_workers, supervise

    settings = settings_or_exit()
    configure_logging(settings.log_format)
    set_log_level(args.log_level)
    if args.worker_of_group:
        return _serve(settings, args.wait_for_database, share_port=True)
    workers = args.workers or min(default_workers(), MAX_WORKERS)
    if workers == 1:
        return _serve(settings, args.wait_for_database)
    if settings.database_url is None:
        raise CliError(
            "--workers needs DATABASE_URL (each worker would start its own embedded Postgres)",
            USAGE,
        )
    # each worker runs with the supervisor's own flags
    flags = ["--log-level", args.log_level, "--wait-for-database", str(args.wait_for_database)]
    return supervise(workers, settings.listen, settings.metrics_listen, flags)
