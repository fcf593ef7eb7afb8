"""The README's worked example: an operator opens a thread, a parser proposes, an
injected write is refused, and a stale writer is told where the head is.

Run it against `make run` in another terminal:

    .venv/bin/python examples/quickstart.py

It connects where `ztate run` listens: ZTATE_ADDRESS, else the port of ZTATE_LISTEN
(default 127.0.0.1:7443) on localhost, with the certificates in $ZTATE_HOME/certs
(default .ztate/certs), the same defaults as the `ztate` command (docs/cli.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from pathlib import Path

from ztate.worker_sdk import PermissionDenied, StaleVersion, ZtateClient


def connect(target: str, certs: Path, identity: str) -> ZtateClient:
    return ZtateClient.from_files(
        target,
        cert=certs / f"{identity}.crt",
        key=certs / f"{identity}.key",
        ca=certs / "ca.crt",
        server_name="localhost",
    )


async def main(target: str, certs: Path) -> None:
    thread = f"order-{uuid.uuid4().hex[:8]}"

    # 1. An operator opens a thread with its initial state (version 0).
    async with connect(target, certs, "operator-admin") as operator:
        genesis = await operator.create_thread(
            thread,
            {
                "raw_text": "please refund order A-42, it arrived broken",
                "authority": {"tenant": "acme", "acting_for": "support desk"},
                "target_user_id": "123e4567-e89b-42d3-a456-426614174000",
            },
            policy="pipeline",
        )
    print(f"created {thread} at version {genesis.version}, digest {genesis.digest[:16]}...")

    async with connect(target, certs, "node-input-parser") as parser:
        # 2. The parser sees only the keys its policy lets it read.
        view = await parser.get_view(thread)
        print(f"parser sees version {view.version}: {view.state}")

        # 3. It proposes a patch against that version; the service commits and signs it.
        action = {"action": "refund", "order_id": "A-42", "amount_cents": 1299}
        committed = await parser.propose(thread, view.version, {"requested_action": action})
        print(f"committed version {committed.version}, signed with key {committed.key_id}")

        # 4. Prompt-injected output tries to grant itself permissions: refused whole.
        try:
            await parser.propose(
                thread, committed.version, {"execution_permissions": ["admin"], "is_admin": True}
            )
        except PermissionDenied as refused:
            print(f"refused: {refused.reason} {list(refused.keys)}")

        # 5. A writer working from an old version is told where the head is.
        try:
            await parser.propose(thread, 0, {"requested_action": {"action": "cancel_order"}})
        except StaleVersion as stale:
            print(f"refused: {stale.reason}, head is at {stale.current_version}")

    # 6. The planner reads what the parser wrote, and only its own keys.
    async with connect(target, certs, "node-planner") as planner:
        print(f"planner sees: {(await planner.get_view(thread)).state}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    listen = os.environ.get("ZTATE_LISTEN", "127.0.0.1:7443")
    local = f"localhost:{listen.rpartition(':')[2]}"
    parser.add_argument(
        "--target",
        default=os.environ.get("ZTATE_ADDRESS", local),
        help="host:port of the transition service (default: ZTATE_ADDRESS, else ZTATE_LISTEN)",
    )
    parser.add_argument(
        "--certs",
        type=Path,
        default=Path(os.environ.get("ZTATE_HOME", ".ztate")) / "certs",
        help="the folder of the development certificates (default $ZTATE_HOME/certs)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.target, args.certs))
