"""The database writer: the privileged node that performs the approved action.

Immediately before a write it fetches the head and proves, with public keys only,
that a human approved exactly the action it is about to perform: the head is the
version it read, the approved patch set ``approved_action`` to exactly the value
it acts on, the approval receipt's Ed25519 signature and its binding to the head
record (thread, base version, transition digest, validity when committed), and a
signed checkpoint of that head. Without that proof it refuses to act. Read-only
lookups need no approval. The policy marks it ``read_records: true``, which is
what lets it read the record and checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _node import main

from ztate.worker_sdk import (
    Handler,
    HeadNotVerified,
    View,
    ZtateClient,
    load_public_keys,
    verify_head_before_acting,
)


def make_handler(client: ZtateClient, thread_id: str, report: Callable[..., None]) -> Handler:
    home = Path(os.environ["ZTATE_HOME"])
    approval_keys = load_public_keys(home / "keys" / "approval-public.json")
    checkpoint_keys = load_public_keys(home / "keys" / "checkpoint-public.json")
    database = home / "demo-orders-db.jsonl"  # the "production database" of the demo
    done: list[Any] = []

    async def handle(view: View) -> dict[str, Any] | None:
        action = view.state.get("approved_action")
        if not action or action in done:
            return None
        done.append(action)
        if action["action"] == "lookup":
            report("acted", action=action, read_only=True)
            return {"result_ref": f"db://orders/{action['order_id']}"}
        try:
            head = await verify_head_before_acting(
                client,
                thread_id,
                approval_keys=approval_keys,
                checkpoint_keys=checkpoint_keys,
                expected_version=view.version,
                expected_digest=view.head_digest,
                acting_on={"approved_action": action},
            )
        except HeadNotVerified as refused:
            report("refused-to-act", check=refused.check, message=refused.message)
            return None
        report(
            "verified",
            version=head.version,
            reviewers=head.receipt["reviewers"],
            receipt_digest=head.record["receipt_digest"],
            transition_digest=head.receipt["transition_digest"],
            checkpoint_version=head.checkpoint["version"],
        )
        with database.open("a", encoding="utf-8") as rows:
            rows.write(json.dumps({"thread": thread_id, **action}) + "\n")
        report("acted", action=action, read_only=False)
        return {"result_ref": f"db://orders/{action['order_id']}/{action['action']}"}

    return handle


if __name__ == "__main__":
    main("db-writer", make_handler)
