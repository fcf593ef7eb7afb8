"""``ztate verify`` and ``ztate ledger export``: the offline verifier as a command.

Scripts act on the exit code: 0 when every check passed, 1 when verification
ran and found failures (each printed, one per line), 2 when it could not run at
all (an unreadable key file or policy, no database, a bundle without a usable
manifest). ``--json`` prints one JSON object per finding and a summary last.

Key material and policies default to the service's own configuration
(``ZTATE_HMAC_KEYRING`` or ``ZTATE_HMAC_KEYRING_FILE``,
``ZTATE_APPROVAL_PUBLIC_KEYS_FILE``, ``ZTATE_POLICY_PATH``), so that on the
service's host the command needs no flags; an auditor elsewhere passes the files.
The database is ``DATABASE_URL``, or the embedded one under ``$ZTATE_HOME/pg``;
the transition service need not run.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ztate.services.cli.resources import bounded_float

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    from ztate.contract.checkpoints import SignedCheckpoint
    from ztate.services.runtime.config import Settings
    from ztate.services.verify.checks import Finding, Report, Summary, Trust

# a checkpoint line is under 2 KB (a thread id of at most 128 characters, digests, a
# signature); the journal may come from the party audited: a longer line stops the run
MAX_CHECKPOINT_LINE = 64 * 1024
EXIT_CANNOT_RUN = 2  # services.verify.checks.EXIT_CANNOT_RUN (a test holds them equal)
MAX_JOBS = 256
MAX_WORKER_TIMEOUT = 86_400.0  # seconds: a day
# services.verify.parallel.WORKER_TIMEOUT (a test holds them equal)
WORKER_TIMEOUT = 300.0
FLUSH_TIMEOUT_MILLIS = 5_000  # per signal, at exit
Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()


def add_verify_commands(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``verify`` to the ``ztate`` command."""
    verify = subparsers.add_parser(
        "verify",
        help="verify the ledger offline: digests, chain, HMACs, receipts, risk rules, policies",
        description="Exit 0: verified; 1: failures found (each printed); 2: could not run.",
    )
    verify.add_argument("--thread", help="verify only this thread")
    verify.add_argument("--bundle", type=Path, help="verify an exported bundle (no database)")
    verify.add_argument(
        "--keyring", type=Path, help="HMAC keyring file (default: the service's keyring)"
    )
    verify.add_argument(
        "--approval-keys",
        type=Path,
        help="approval public keys file (default: ZTATE_APPROVAL_PUBLIC_KEYS_FILE)",
    )
    verify.add_argument(
        "--policy", type=Path, help="policy file or folder (default: ZTATE_POLICY_PATH)"
    )
    verify.add_argument(
        "--public-only",
        action="store_true",
        help="no HMAC key: check chain links and signed checkpoints with public keys alone",
    )
    verify.add_argument(
        "--checkpoint-keys",
        type=Path,
        help="checkpoint public keys (default: ZTATE_CHECKPOINT_PUBLIC_KEYS_FILE)",
    )
    verify.add_argument(
        "--checkpoints",
        type=Path,
        metavar="FILE",
        help="signed checkpoints kept outside the database (the signer's journal, "
        "ZTATE_CHECKPOINT_JOURNAL_FILE, or a copy): the chain must pass through each",
    )
    verify.add_argument(
        "--signed-manifest",
        action="store_true",
        help="a bundle must carry manifest.sig, the checkpoint key's signature over its "
        "manifest (checked whenever present and the checkpoint keys are at hand)",
    )
    verify.add_argument(
        "--jobs",
        type=_jobs,
        metavar="N",
        help="verify threads on N worker processes (0: one per core; default 1)",
    )
    verify.add_argument(
        "--worker-timeout",
        type=bounded_float(1.0, MAX_WORKER_TIMEOUT),
        metavar="SECONDS",
        help="with --jobs N (not 1): stop the run (exit 2, no verdict) when a worker verifies "
        "nothing for this long: stuck on a lock, a dead connection or a loop "
        f"(default {WORKER_TIMEOUT:g})",
    )
    verify.add_argument(
        "--reference-only",
        action="store_true",
        help="check every record with the reference verifier (Python) alone, none with the "
        "compiled lane: the same verdict and findings, 5 to 7 times slower",
    )
    verify.add_argument("--json", action="store_true", help="one JSON object per line")
    verify.set_defaults(func=cmd_verify)


def _jobs(text: str) -> int:
    """``--jobs`` as given (0: one per core, counted when the command runs)."""
    try:
        jobs = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= jobs <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"must be 0 (one per core) to {MAX_JOBS}")
    return jobs


def _workers(args: argparse.Namespace) -> tuple[int, float]:
    """The worker processes ``--jobs`` asks for, and their ``--worker-timeout``. The
    timeout bounds a worker process's silence: without workers (no ``--jobs``, or
    ``--jobs 1``) there is none to bound, and a timeout given then is a usage error
    rather than a setting silently without effect. (``--jobs 0`` asks for workers,
    even on a machine where one per core is one.)"""
    from ztate.services.cli.output import usage
    from ztate.services.verify.parallel import jobs_wanted

    if args.worker_timeout is not None and args.jobs in (None, 1):
        usage(
            "--worker-timeout bounds the worker processes of --jobs N: give --jobs (2 or "
            "more, or 0: one per core) or leave --worker-timeout out"
        )
    jobs = jobs_wanted(1 if args.jobs is None else args.jobs)
    return jobs, WORKER_TIMEOUT if args.worker_timeout is None else args.worker_timeout


def register(commands: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``verify`` to the ``ztate`` command (``ledger export`` joins ``ledger``)."""
    add_verify_commands(commands)


def add_export_command(ledger_subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``export`` to the ``ztate ledger`` group."""
    export = ledger_subparsers.add_parser(
        "export", help="write a self-contained bundle that `ztate verify --bundle` checks"
    )
    export.add_argument("--out", type=Path, required=True, help="an empty or new folder")
    export.add_argument("--thread", help="export only this thread")
    export.set_defaults(func=cmd_ledger_export)


# --- verify -----------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from ztate.contract.record import printable
    from ztate.services.runtime.telemetry import Telemetry
    from ztate.services.verify.bundle import verify_bundle
    from ztate.services.verify.checks import VerifyError, counted, no_such_thread
    from ztate.services.verify.parallel import verify_bundle_parallel

    jobs, worker_timeout = _workers(args)
    telemetry = Telemetry()
    ticking = _progress(enabled=not args.json and sys.stderr.isatty())
    try:
        settings = _settings()
        telemetry = Telemetry.from_settings(settings)  # ztate.verify.failures, when on
        telemetry.install_globals()
        trust = _trust(args, settings)
        printer = _Printer(json_lines=args.json)
        report = counted(printer.finding)  # here, in the leader, whatever --jobs says
        if args.bundle is not None and jobs > 1:
            summary = verify_bundle_parallel(
                args.bundle,
                trust,
                report,
                jobs=jobs,
                thread_id=args.thread,
                worker_timeout=worker_timeout,
            )
        elif args.bundle is not None:
            summary = verify_bundle(args.bundle, trust, report, thread_id=args.thread)
        else:
            summary = _verify_database(settings, trust, report, args.thread, jobs, worker_timeout)
        if (
            args.thread is not None
            and summary.threads == 0
            and args.thread not in trust.kept_checkpoints
        ):
            raise no_such_thread(args.thread)
        printer.summary(summary)
    except _OutputLost as lost:
        if isinstance(lost.error, BrokenPipeError):
            raise lost.error from None  # the reader went away: 141, as every command
        # the verdict could not be written: no verdict a script can read, so not 0 or 1
        said = lost.error.strerror or type(lost.error).__name__
        print(f"ztate verify: cannot verify: cannot write the output: {said}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except VerifyError as exc:
        print(f"ztate verify: cannot verify: {printable(str(exc))}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except Exception as failure:  # MemoryError too: no verdict, whatever broke
        # a crash is no finding: exit 1 would tell a script the ledger was tampered with
        # (and an exception's text may hold the ledger's bytes: its type alone is said)
        print(
            f"ztate verify: cannot verify: the verifier failed ({type(failure).__name__}); "
            "the ledger is NOT verified",
            file=sys.stderr,
        )
        return EXIT_CANNOT_RUN
    finally:
        ticking.set()
        # bounded: a collector that is down must not hang the verdict
        if not telemetry.force_flush(FLUSH_TIMEOUT_MILLIS):
            print("ztate verify: telemetry not exported (collector unreachable)", file=sys.stderr)
    return summary.exit_code


def _progress(*, enabled: bool) -> threading.Event:
    """On a terminal, a line on stderr every second while verification runs (how long,
    so far); cleared at the end. Set the returned event to stop it."""
    stop = threading.Event()
    if not enabled:
        return stop

    def tick() -> None:
        started = time.monotonic()
        while not stop.wait(1.0):
            sys.stderr.write(f"\rverifying... {time.monotonic() - started:.0f}s")
            sys.stderr.flush()
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()

    threading.Thread(target=tick, name="ztate-verify-progress", daemon=True).start()
    return stop


class _OutputLost(Exception):
    """Stdout failed under the printer (full, closed, the reader gone): told apart from
    a failure of the verifier (every ``OSError`` of a run is not stdout's)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Printer:
    """Prints each finding as it is found, so a long run shows progress."""

    def __init__(self, *, json_lines: bool) -> None:
        self._json = json_lines

    def finding(self, finding: Finding) -> None:
        if self._json:
            self._line({"type": "finding", **finding.as_json()})
        else:
            self._text(f"FAIL {finding}")

    def summary(self, summary: Summary) -> None:
        if self._json:
            self._line({"type": "summary", **summary.as_json()})
            return
        counted = f"{summary.threads} threads, {summary.records} records"
        if summary.failures:
            self._text(f"FAILED: {summary.failures} failures in {counted}")
        else:
            self._text(f"OK: verified {counted}")

    @staticmethod
    def _text(line: str) -> None:
        try:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        except OSError as error:
            raise _OutputLost(error) from None

    @staticmethod
    def _line(doc: dict[str, Any]) -> None:
        """One JSON line, as orjson's UTF-8 bytes, straight to stdout's byte stream:
        not decoded to text only for stdout to encode it again. Nothing in JSON mode
        writes text to stdout, so no text waits in front of it."""
        import orjson

        try:
            sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE))
            sys.stdout.buffer.flush()
        except OSError as error:
            raise _OutputLost(error) from None


def _settings() -> Settings:
    from pydantic import ValidationError

    from ztate.services.runtime.config import Settings, describe
    from ztate.services.verify.checks import VerifyError

    try:
        return Settings()
    except ValidationError as exc:
        raise VerifyError(f"invalid configuration: {describe(exc)}") from None


def _trust(args: argparse.Namespace, settings: Settings) -> Trust:
    from ztate.contract.errors import KeyFileError, KeyringError
    from ztate.contract.keyring import Keyring
    from ztate.services.policy.model import PolicyError, load_policy_versions
    from ztate.services.verify.checks import Trust, VerifyError

    try:
        keyring: Keyring | None = None
        if args.public_only:
            pass
        elif args.keyring is not None:
            keyring = Keyring.load(args.keyring, None)
        else:
            env = settings.hmac_keyring.get_secret_value() if settings.hmac_keyring else None
            keyring = Keyring.load(settings.hmac_keyring_file, env)
        approval_keys = _approval_keys(args.approval_keys, settings)
        checkpoint_keys = _checkpoint_keys(args, settings)
        kept = _kept_checkpoints(args.checkpoints, checkpoint_keys)
        assert settings.policy_path is not None
        # every version of every policy given, by digest: a folder may hold two
        # versions of one policy (the database and bundles keep them as well)
        policies = load_policy_versions(args.policy or settings.policy_path)
    except (KeyringError, KeyFileError, PolicyError) as exc:
        raise VerifyError(str(exc)) from None
    if args.signed_manifest and checkpoint_keys is None:
        raise VerifyError("--signed-manifest needs the checkpoint public keys (--checkpoint-keys)")
    return Trust(
        keyring,
        approval_keys,
        policies,
        checkpoint_keys,
        kept,
        require_signed_manifest=args.signed_manifest,
        reference_only=args.reference_only,
    )


def _kept_checkpoints(
    path: Path | None, keys: dict[str, Ed25519PublicKey] | None
) -> dict[str, dict[int, SignedCheckpoint]]:
    """The checkpoints of ``--checkpoints FILE``, by thread and version. Their
    signatures are checked where the chain meets them, as the database's are."""
    from ztate.contract.checkpoints import parse_checkpoint_line
    from ztate.contract.errors import CheckpointInvalid
    from ztate.services.verify.checks import VerifyError

    if path is None:
        return {}
    if keys is None:
        raise VerifyError("--checkpoints needs the checkpoint public keys (--checkpoint-keys)")
    kept: dict[str, dict[int, SignedCheckpoint]] = {}
    try:
        with path.open("rb") as handle:
            number = 0
            while line := handle.readline(MAX_CHECKPOINT_LINE + 1):  # never more held
                number += 1
                if len(line) > MAX_CHECKPOINT_LINE:
                    raise VerifyError(
                        f"{path}: line {number}: longer than {MAX_CHECKPOINT_LINE:,} bytes, "
                        "which no checkpoint is"
                    )
                try:
                    thread_id, version, signed = parse_checkpoint_line(line)
                except CheckpointInvalid as exc:
                    raise VerifyError(f"{path}: line {number}: {exc.message}") from None
                kept.setdefault(thread_id, {})[version] = signed
    except OSError as exc:
        raise VerifyError(f"{path}: cannot read ({exc.strerror})") from None
    return kept


def _checkpoint_keys(
    args: argparse.Namespace, settings: Settings
) -> dict[str, Ed25519PublicKey] | None:
    """Checkpoints are checked whenever their public keys are at hand; public-only
    verification needs them."""
    from ztate.contract.keyring import load_public_keys
    from ztate.services.verify.checks import VerifyError

    if args.checkpoint_keys is not None:  # given: they load, or the run cannot go on
        return load_public_keys(Path(args.checkpoint_keys))
    default = settings.checkpoint_public_keys_file  # configured: may not exist yet
    if default is not None and Path(default).exists():
        return load_public_keys(Path(default))
    if args.public_only:
        raise VerifyError("--public-only needs the checkpoint public keys (--checkpoint-keys)")
    return None


def _approval_keys(path: Path | None, settings: Settings) -> dict[str, Ed25519PublicKey]:
    """Given keys must load; the configured default may be absent (no approvals yet),
    in which case any receipt in the ledger fails to verify, precisely."""
    from ztate.contract.keyring import load_public_keys

    if path is not None:
        return load_public_keys(path)
    default = settings.approval_public_keys_file
    if default is None or not default.exists():
        print(
            f"ztate verify: no approval public keys at {default}: receipts cannot verify",
            file=sys.stderr,
        )
        return {}
    return load_public_keys(default)


def _verify_database(
    settings: Settings,
    trust: Trust,
    report: Report,
    thread_id: str | None,
    jobs: int,
    worker_timeout: float,
) -> Summary:
    import asyncio

    from ztate.services.verify.checks import verify_database
    from ztate.services.verify.parallel import verify_database_parallel

    dsn, _embedded = _database(settings)
    if jobs > 1:
        return asyncio.run(
            verify_database_parallel(
                dsn,
                trust,
                report,
                jobs=jobs,
                thread_id=thread_id,
                worker_timeout=worker_timeout,
            )
        )
    return asyncio.run(verify_database(dsn, trust, report, thread_id=thread_id))


def settings_or_verify_error() -> Settings:
    """The service's settings, or ``VerifyError`` saying what is wrong in them."""
    return _settings()


def database_dsn(settings: Settings) -> tuple[str, Any]:
    """The database operator tools (verify, export, prune) run against."""
    return _database(settings)


def _database(settings: Settings) -> tuple[str, Any]:
    """``DATABASE_URL``, or the embedded Postgres that ``ztate run`` keeps under the home.
    The second value keeps the embedded server alive while it is used."""
    from ztate.services.verify.checks import VerifyError

    if settings.database_url is not None:
        return settings.database_url.get_secret_value(), None
    data = settings.home / "pg"
    if not data.exists():
        raise VerifyError(f"DATABASE_URL is unset and there is no embedded database at {data}")
    from ztate.services.store.embedded import start_embedded_postgres

    return start_embedded_postgres(data)


# --- export -----------------------------------------------------------------------------


def cmd_ledger_export(args: argparse.Namespace) -> int:
    import asyncio

    from ztate.contract.record import printable
    from ztate.services.cli.output import NOT_FOUND
    from ztate.services.verify.bundle import NothingToExport, export_bundle
    from ztate.services.verify.checks import VerifyError

    try:
        settings = _settings()
        signer = _manifest_signer(settings)
        dsn, _embedded = _database(settings)
        manifest = asyncio.run(export_bundle(dsn, args.out, args.thread, signer=signer))
    except NothingToExport as exc:  # exit 3, as every command that finds nothing
        print(f"ztate ledger export: {printable(str(exc))}", file=sys.stderr)
        return NOT_FOUND
    except VerifyError as exc:
        print(f"ztate ledger export: {printable(str(exc))}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    signed = (
        f"manifest signed with checkpoint key {signer[0]!r}"
        if signer is not None
        else f"manifest NOT signed: no checkpoint key at {settings.checkpoint_key_file}"
    )
    print(
        f"exported {manifest.records} records of {manifest.threads} threads to {args.out} "
        f"(records.jsonl sha256 {manifest.records_sha256}; {signed})"
    )
    return 0


def _manifest_signer(settings: Settings) -> tuple[str, Ed25519PrivateKey] | None:
    """The checkpoint signing key, where the export runs beside it (the service's host):
    it signs the bundle's manifest. Absent: the bundle is exported unsigned."""
    path = settings.checkpoint_key_file
    if path is None or not Path(path).exists():
        return None
    from ztate.contract.errors import KeyFileError
    from ztate.contract.keyring import load_signing_key
    from ztate.services.verify.checks import VerifyError

    try:
        return settings.checkpoint_key_id, load_signing_key(Path(path))
    except KeyFileError as exc:
        raise VerifyError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """The two commands on their own (``python -m ztate.services.cli.verify``), for
    hosts where only the verifier is installed."""
    parser = argparse.ArgumentParser(prog="ztate", description="verify and export the ledger")
    sub = parser.add_subparsers(dest="command", required=True)
    add_verify_commands(sub)
    ledger = sub.add_parser("ledger", help="the ledger")
    add_export_command(ledger.add_subparsers(dest="ledger_command", required=True))
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
