"""``ztate serve --workers N``: N processes of the transition service on one port.

One Python process uses at most one core (the event loop runs the gRPC machinery, the
pipeline and asyncpg's protocol), so a machine with more cores runs one process per
core. Each worker is a whole service (its own pools, head cache and outbox), exactly as
replicas behind a load balancer are: the compare-and-swap keeps them correct without
coordination, and a commit's announcement reaches every replica's watchers
(LISTEN/NOTIFY). The kernel spreads incoming connections over them: every worker binds
the port with SO_REUSEPORT.

The port stays the service's own. Before starting its workers the supervisor binds the
address itself WITHOUT SO_REUSEPORT: that fails if anything is bound there, including
another ztate service's workers, so a second service is refused as a single process
is (``ztate: cannot start``, exit 2). Linux admits to a SO_REUSEPORT group only sockets
of the same user; a foreign service of the same user that sets SO_REUSEPORT itself
could still join between the check and the workers' bind: run services under their own
users. Each worker dies with its supervisor (PR_SET_PDEATHSIG), so a supervisor killed
with SIGKILL leaves no worker serving; SIGTERM and SIGINT are passed on, and the
supervisor exits when every worker has, with the first failure's status.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

from ztate.services.runtime.config import parse_listen

PR_SET_PDEATHSIG = 1
WORKER_FLAG = "--worker-of-group"


def port_is_free(listen: str) -> bool:
    """Whether ``host:port`` can be bound exclusively right now, as gRPC binds it
    (``SO_REUSEADDR``: a port a stopped server left in TIME_WAIT is free)."""
    # validated with the settings; ":port" is every interface, as the service binds it
    host, port = parse_listen(f"0.0.0.0{listen}" if listen.startswith(":") else listen)  # noqa: S104
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:  # in the child, before exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def metrics_listens(metrics_listen: str | None, workers: int) -> list[str | None]:
    """Each worker's own scrape endpoint (``ZTATE_METRICS_LISTEN``): worker k (from 0)
    on the configured port + k, since each process has its own metrics and probes (a
    shared port would answer a scrape from whichever worker the kernel picked); port 0:
    each picks a free one. Raises ``ValueError`` when the ports would pass 65535."""
    if metrics_listen is None:
        return [None] * workers
    host, port = parse_listen(metrics_listen)
    if port == 0:
        return [metrics_listen] * workers
    if port + workers - 1 > 65535:
        raise ValueError(
            f"ZTATE_METRICS_LISTEN {metrics_listen}: {workers} ports from it pass 65535"
        )
    shown = f"[{host}]" if ":" in host else host
    return [f"{shown}:{port + k}" for k in range(workers)]


def supervise(
    workers: int, listen: str, metrics_listen: str | None = None, flags: Sequence[str] = ()
) -> int:
    """Start ``workers`` copies of ``ztate serve`` sharing ``listen``, each with its own
    metrics endpoint (``metrics_listens``) and the supervisor's ``flags``; wait for all."""
    try:
        metrics = metrics_listens(metrics_listen, workers)
    except ValueError as exc:
        print(f"ztate: cannot start: {exc}", file=sys.stderr)
        return 2
    for address in [listen, *(m for m in metrics if m and not m.endswith(":0"))]:
        if not port_is_free(address):
            print(f"ztate: cannot start: {address} is in use", file=sys.stderr)
            return 2
    argv = [sys.executable, "-m", "ztate.services.cli.main", "serve", *flags, WORKER_FLAG]
    children = []
    for number, own in enumerate(metrics):
        env = dict(os.environ)
        if own is not None:
            env["ZTATE_METRICS_LISTEN"] = own
            print(f"ztate: worker {number}: metrics and probes on {own}", file=sys.stderr)
        children.append(subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent))

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    by_pid = {child.pid: child for child in children}
    while by_pid:
        pid, raw = os.waitpid(-1, 0)  # blocks until a worker exits (signals are handled)
        child = by_pid.pop(pid, None)
        if child is None:
            continue
        child.returncode = code = os.waitstatus_to_exitcode(raw)
        if code != 0 and status == 0:
            status = code if code > 0 else 1
            forward(signal.SIGTERM, None)  # one failed: the group stops
    return status


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
