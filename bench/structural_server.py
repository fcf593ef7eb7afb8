"""(e) The structural ceiling's server: one mTLS RPC, one commit, the answer.

Run as ``python -m bench.structural_server PORT CERT KEY CA DSN ROLE POOL_SIZE KEYRING``.
It is the echo server (``bench.echo_server``: grpc.aio, uvloop, the transition
service's server options, client certificates required) whose one handler runs
the transition store's one-statement commit (``ztate.services.store.transitions.COMMIT``,
through an asyncpg pool set up as the service's) and answers the new version. It
does nothing of ztate: no identity, no policy, no canonical JSON, no signature. It
is what any design with one RPC and one commit per transition costs on this stack.

A request is ``thread_id`` and the version to commit from, as ``thread_id\\nversion\\n``,
followed by the patch's bytes (read and dropped). The heads are created by the load
generator (``bench.floor.HeadWriter.create``) before the run.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import grpc
import uvloop

from bench.echo_server import SERVER_OPTIONS
from bench.environment import Credentials
from bench.floor import CommitPayload, commit_args, commit_payload, keep_session
from bench.workload import DEFAULT_POLICY, receipt_patch
from ztate.contract.keyring import Keyring
from ztate.services.policy.model import Policy
from ztate.services.store.transitions import COMMIT

SERVICE = "ztate.bench.v1.Commit"
METHOD = "Commit"
FULL_METHOD = f"/{SERVICE}/{METHOD}"


def request_bytes(thread_id: str, version: int, patch_json: bytes) -> bytes:
    return f"{thread_id}\n{version}\n".encode() + patch_json


class Committer:
    def __init__(self, pool: asyncpg.Pool, payload: CommitPayload) -> None:
        self._pool = pool
        self._payload = payload

    async def commit(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        thread_id, version, _patch = request.split(b"\n", 2)
        expected = int(version)
        committed = await self._pool.fetchval(
            COMMIT,
            *commit_args(self._payload, thread_id.decode(), expected, datetime.now(UTC)),
        )
        if committed is None:
            await context.abort(grpc.StatusCode.ABORTED, "compare-and-swap lost")
        return str(expected + 1).encode()


async def serve(
    port: int, credentials: Credentials, dsn: str, role: str, pool_size: int, keyring: Path
) -> None:
    payload = commit_payload(
        receipt_patch(1024), Keyring.load(keyring, None), Policy.load(DEFAULT_POLICY).digest
    )
    pool = await asyncpg.create_pool(
        dsn,
        min_size=pool_size,
        max_size=pool_size,
        reset=keep_session,
        server_settings={"role": role, "application_name": "ztate-bench-structural"},
    )
    committer = Committer(pool, payload)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(committer.commit)}
    )
    server.add_generic_rpc_handlers((handler,))
    if server.add_secure_port(f"127.0.0.1:{port}", credentials.server_credentials()) == 0:
        raise SystemExit(f"structural server: cannot listen on 127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1.0)
    await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.structural_server")
    parser.add_argument("port", type=int)
    parser.add_argument("cert", type=Path)
    parser.add_argument("key", type=Path)
    parser.add_argument("ca", type=Path)
    parser.add_argument("dsn")
    parser.add_argument("role")
    parser.add_argument("pool_size", type=int)
    parser.add_argument("keyring", type=Path)
    args = parser.parse_args()
    uvloop.run(
        serve(
            args.port,
            Credentials(args.cert, args.key, args.ca),
            args.dsn,
            args.role,
            args.pool_size,
            args.keyring,
        )
    )


if __name__ == "__main__":
    main()
