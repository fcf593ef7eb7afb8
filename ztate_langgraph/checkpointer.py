"""``ZtateCheckpointSaver``: LangGraph checkpoints kept in the ztate ledger.

Each LangGraph thread is one ztate thread (``ledger_thread_id``) bound to the policy of
``checkpoint_policy``: one key, ``entry``, that the checkpointer node may read and
write. Every ``put``, ``put_writes`` and ``delete_thread`` proposes one patch
``{"entry": <JSON text>}``, so each becomes a signed, chained ledger record under the
checkpointer's own identity. Reading walks the thread's records from genesis and
checks, before anything is deserialised, that each record's bytes hash to its digest,
are canonical, sit at the version asked for and name their predecessor's digest as
parent, and that the last one is the head the service reports. A record altered in
storage raises ``CheckpointNotVerified`` naming the failed check; its bytes are never
handed to the serialiser.

Deleting a thread appends a ``delete`` entry: the checkpoints before it are no longer
served; their records (and digests) stay in the ledger for audit.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from ztate.contract.canonical import sha256_hex
from ztate.contract.errors import ContractError
from ztate.contract.record import GENESIS_PARENT, KIND_GENESIS, KIND_TRANSITION, parse_record
from ztate.worker_sdk import AlreadyExists, NotFound, StaleVersion, ZtateClient

CHECKPOINTER_NODE = "langgraph-checkpointer"
POLICY_NAME = "langgraph-checkpoints"
ENTRY_KEY = "entry"
ENTRY_MAX = 1_000_000
ENTRY_FORMAT = 1
PROPOSE_ATTEMPTS = 32
CACHED_THREADS = 1024  # verified chains a saver keeps (least recently used go first)
CACHED_BYTES = 256 * 1024 * 1024  # and their entries' bytes, at most (the same order)


def checkpoint_policy(node: str = CHECKPOINTER_NODE, name: str = POLICY_NAME) -> dict[str, Any]:
    """The ztate policy a checkpointer thread is bound to: one opaque key, ``entry``,
    read and written by ``node`` alone, which reads its records to verify them."""
    return {
        "format": 1,
        "name": name,
        "description": "LangGraph checkpoints: one ledger record per checkpoint or write set",
        "keys": {
            ENTRY_KEY: {
                "layer": "working",
                "type": "string",
                "max_length": ENTRY_MAX,
                "opaque": True,
            }
        },
        "nodes": {
            node: {
                "layer": "working",
                "read": [ENTRY_KEY],
                "write": [ENTRY_KEY],
                "read_records": True,
            }
        },
    }


def ledger_thread_id(thread_id: str) -> str:
    """The ztate thread of a LangGraph thread (any Unicode string maps to a valid, fixed
    id; one holding a lone surrogate, which no entry could carry, is a ValueError)."""
    try:
        encoded = thread_id.encode()
    except UnicodeEncodeError:
        raise ValueError("a LangGraph thread id must be Unicode text (a lone surrogate)") from None
    return "lg-" + hashlib.sha256(encoded).hexdigest()[:48]


class CheckpointNotVerified(Exception):
    """A ledger record of a checkpoint thread failed verification: nothing of it was
    deserialised. ``check`` names the failed check (``record.digest``, ``record.form``,
    ``record.version``, ``record.thread``, ``record.parent``, ``head.digest``,
    ``entry.form``)."""

    def __init__(self, message: str, *, check: str, thread_id: str, version: int) -> None:
        super().__init__(f"{message} ({check}, {thread_id}@{version})")
        self.check = check
        self.thread_id = thread_id
        self.version = version


@dataclass
class _Chain:
    """The verified records of one ledger thread: digest and entry by version."""

    digests: list[str] = field(default_factory=list)
    entries: list[dict[str, Any] | None] = field(default_factory=list)
    size: int = 0  # the bytes of the records whose entries are kept


def _require_text(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class ZtateCheckpointSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer on ztate (async; the sync methods run the async ones on
    the event loop the saver was created on, from another thread).

    ``node`` is a client holding the checkpointer node's certificate; ``operator``, if
    given, creates each LangGraph thread's ledger thread on first use (otherwise an
    operator creates them beforehand, bound to ``policy``).
    """

    def __init__(
        self,
        node: ZtateClient,
        operator: ZtateClient | None = None,
        *,
        policy: str = POLICY_NAME,
        serde: SerializerProtocol | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        # LangGraph's default serialiser imports and calls any function a msgpack
        # payload names (a warning, not a refusal, in langgraph-checkpoint 4): a record
        # rewritten consistently in storage (digest, head and all: the saver's checks
        # use no secret) would run code on load. The saver's default constructs only
        # LangGraph's safe types (messages, datetimes, ...); pass a serde with an
        # allowlist for types of your own.
        super().__init__(
            serde=serde if serde is not None else JsonPlusSerializer(allowed_msgpack_modules=None)
        )
        self.node = node
        self.operator = operator
        self.policy = policy
        self.loop = loop or asyncio.get_running_loop()
        # the verified chains of the threads used last (at most CACHED_THREADS; one
        # evicted is verified again from its genesis when next used)
        self._chains: OrderedDict[str, _Chain] = OrderedDict()
        self._cached_bytes = 0  # the sum of their sizes
        # a thread's lock lives while a call holds or waits for it
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    # -- the ledger ------------------------------------------------------------------

    def _lock(self, ledger_id: str) -> asyncio.Lock:
        lock = self._locks.get(ledger_id)
        if lock is None:
            lock = self._locks[ledger_id] = asyncio.Lock()
        return lock

    async def _verified(self, ledger_id: str) -> _Chain | None:
        """The thread's records up to the head, each verified (None: no such thread).
        The chain is extended under the thread's lock: two readers extending it at once
        checked a record against a parent the other had just appended (a false
        ``record.parent``)."""
        async with self._lock(ledger_id):
            return await self._verified_locked(ledger_id)

    async def _verified_locked(self, ledger_id: str) -> _Chain | None:
        try:
            view = await self.node.get_view(ledger_id)
        except NotFound:
            return None
        chain = self._chains.get(ledger_id) or _Chain()
        self._chains[ledger_id] = chain
        self._chains.move_to_end(ledger_id)
        if len(chain.digests) > view.version + 1:  # the ledger never shrinks
            raise CheckpointNotVerified(
                f"head went back to version {view.version}",
                check="head.digest",
                thread_id=ledger_id,
                version=view.version,
            )
        kept = chain.size
        try:
            for version in range(len(chain.digests), view.version + 1):
                found = await self.node.get_record(ledger_id, version=version)
                parent = chain.digests[-1] if chain.digests else GENESIS_PARENT
                record_json = found.transition.record_json
                entry = self._check(
                    ledger_id, version, record_json, found.transition.digest, parent
                )
                chain.digests.append(found.transition.digest)
                chain.entries.append(entry)
                chain.size += len(record_json)
                if entry is not None and entry.get("kind") == "delete":
                    # nothing before a delete is served again: its bodies leave the cache
                    chain.entries[:-1] = [None] * (len(chain.entries) - 1)
                    chain.size = len(record_json)
        finally:  # the records verified so far are kept, and counted
            self._cached_bytes += chain.size - kept
            self._evict(keep=ledger_id)
        if chain.digests[view.version] != view.head_digest:
            raise CheckpointNotVerified(
                "the head's digest is not the verified record's",
                check="head.digest",
                thread_id=ledger_id,
                version=view.version,
            )
        return chain

    def _evict(self, keep: str) -> None:
        """Drop the least recently used chains (never ``keep``, the one in use) past
        ``CACHED_THREADS`` chains or ``CACHED_BYTES`` of kept records: a dropped one is
        read and verified again from its genesis when next used."""
        while len(self._chains) > 1 and (
            len(self._chains) > CACHED_THREADS or self._cached_bytes > CACHED_BYTES
        ):
            oldest = next(iter(self._chains))
            if oldest == keep:
                self._chains.move_to_end(keep)
                continue
            self._cached_bytes -= self._chains.pop(oldest).size

    @staticmethod
    def _check(
        ledger_id: str, version: int, record_json: bytes, digest: str, parent: str
    ) -> dict[str, Any] | None:
        def refuse(message: str, check: str) -> CheckpointNotVerified:
            return CheckpointNotVerified(message, check=check, thread_id=ledger_id, version=version)

        if sha256_hex(record_json) != digest:
            raise refuse("the record's bytes do not hash to its digest", "record.digest")
        try:
            record = parse_record(record_json)
        except ContractError as error:
            raise refuse(str(error), "record.form") from None
        if record["version"] != version:
            raise refuse(f"record of version {record['version']}", "record.version")
        if record["thread_id"] != ledger_id:
            raise refuse(f"record of thread {record['thread_id']!r}", "record.thread")
        if record["parent_digest"] != parent:
            raise refuse("the record does not chain to its predecessor", "record.parent")
        expected = KIND_GENESIS if version == 0 else KIND_TRANSITION
        if record["kind"] != expected:
            # an operator's revert restores an earlier entry as if it were appended: after
            # a delete it would serve a deleted checkpoint again. Not a LangGraph operation
            raise refuse(
                f"a {record['kind']} record where the saver writes only checkpoint entries",
                "record.kind",
            )
        text = record["patch"].get(ENTRY_KEY)
        if version == 0 or text is None:
            return None
        try:
            entry = json.loads(text)
        except (TypeError, ValueError):
            raise refuse("the entry is not JSON", "entry.form") from None
        if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT:
            raise refuse("the entry is not a format-1 checkpoint entry", "entry.form")
        return entry

    async def _append(self, thread_id: str, entry: dict[str, Any]) -> None:
        """Propose ``entry`` on the thread's head (creating the thread if needed)."""
        ledger_id = ledger_thread_id(thread_id)
        patch = {
            ENTRY_KEY: json.dumps(
                {"format": ENTRY_FORMAT, "thread_id": thread_id, **entry}, separators=(",", ":")
            )
        }
        async with self._lock(ledger_id):
            created = False
            for _ in range(PROPOSE_ATTEMPTS):
                chain = await self._verified_locked(ledger_id)
                if chain is None and created:
                    # it exists (the create said so) yet this node cannot see it: bound to
                    # another policy, another workflow's thread of the same id
                    raise LookupError(
                        f"ledger thread {ledger_id} exists but not under policy "
                        f"{self.policy!r}: another workflow holds this LangGraph thread id"
                    )
                if chain is None:
                    await self._create(ledger_id)
                    created = True
                    continue
                try:
                    await self.node.propose(ledger_id, len(chain.digests) - 1, patch)
                    return
                except StaleVersion:
                    continue  # another writer committed first: verify its record, retry
            raise RuntimeError(f"could not append to {ledger_id}: the head kept moving")

    async def _create(self, ledger_id: str) -> None:
        if self.operator is None:
            raise LookupError(
                f"ledger thread {ledger_id} does not exist and this saver has no operator "
                "client to create it"
            )
        with contextlib.suppress(AlreadyExists):
            await self.operator.create_thread(ledger_id, {}, policy=self.policy)

    # -- reading entries ---------------------------------------------------------------

    async def _entries(self, thread_id: str) -> list[dict[str, Any]]:
        """The thread's entries since its last deletion, verified, oldest first."""
        chain = await self._verified(ledger_thread_id(thread_id))
        if chain is None:
            return []
        live: list[dict[str, Any]] = []
        for entry in chain.entries:
            if entry is None:
                continue
            if entry.get("thread_id") != thread_id:
                raise CheckpointNotVerified(
                    "an entry of another LangGraph thread",
                    check="entry.form",
                    thread_id=ledger_thread_id(thread_id),
                    version=len(live),
                )
            if entry["kind"] == "delete":
                live = []
            else:
                live.append(entry)
        return live

    def _load(self, typed: list[str]) -> Any:
        return self.serde.loads_typed((typed[0], base64.b64decode(typed[1])))

    def _dump(self, value: Any) -> list[str]:
        kind, data = self.serde.dumps_typed(value)
        return [kind, _b64(data)]

    def _tuples(
        self, thread_id: str, entries: list[dict[str, Any]], ns: str | None
    ) -> list[tuple[dict[str, Any], list[tuple[str, str, Any]]]]:
        """Each checkpoint (the last put of each id wins), newest id first, with its
        pending writes."""
        checkpoints: dict[tuple[str, str], dict[str, Any]] = {}
        writes: dict[tuple[str, str], dict[tuple[str, int], dict[str, Any]]] = {}
        for entry in entries:
            key = (
                entry["ns"],
                entry["id"] if entry["kind"] == "checkpoint" else entry["checkpoint_id"],
            )
            if ns is not None and key[0] != ns:
                continue
            if entry["kind"] == "checkpoint":
                checkpoints[key] = entry
            elif entry["kind"] == "writes":
                held = writes.setdefault(key, {})
                for write in entry["writes"]:
                    inner = (entry["task_id"], write["idx"])
                    if inner[1] >= 0 and inner in held:
                        continue
                    held[inner] = {**write, "task_id": entry["task_id"]}
        ordered = sorted(checkpoints.items(), key=lambda item: item[0][1], reverse=True)
        return [
            (
                entry,
                [(w["task_id"], w["channel"], w["value"]) for w in writes.get(key, {}).values()],
            )
            for key, entry in ordered
        ]

    def _tuple(
        self, thread_id: str, entry: dict[str, Any], pending: list[tuple[str, str, Any]]
    ) -> CheckpointTuple:
        config: RunnableConfig = {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": entry["ns"],
                "checkpoint_id": entry["id"],
            }
        }
        parent: RunnableConfig | None = None
        if entry["parent_id"]:
            parent = {
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": entry["ns"],
                    "checkpoint_id": entry["parent_id"],
                }
            }
        return CheckpointTuple(
            config=config,
            checkpoint=self._load(entry["checkpoint"]),
            metadata=self._load(entry["metadata"]),
            parent_config=parent,
            pending_writes=[(task, channel, self._load(value)) for task, channel, value in pending],
        )

    # -- the async API -----------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns") or ""  # None is the root, as LangGraph's
        wanted = get_checkpoint_id(config)
        for entry, pending in self._tuples(thread_id, await self._entries(thread_id), ns):
            if wanted is None or entry["id"] == wanted:
                return self._tuple(thread_id, entry, pending)
        return None

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        if config is None:
            raise ValueError(
                "ZtateCheckpointSaver lists one thread at a time: a node cannot enumerate "
                "threads (give config with a thread_id)"
            )
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns")
        wanted = get_checkpoint_id(config)
        before_id = get_checkpoint_id(before) if before else None
        count = 0
        for entry, pending in self._tuples(thread_id, await self._entries(thread_id), ns):
            if wanted is not None and entry["id"] != wanted:
                continue
            if before_id is not None and entry["id"] >= before_id:
                continue
            found = self._tuple(thread_id, entry, pending)
            if filter and not all(found.metadata.get(k) == v for k, v in filter.items()):
                continue
            if limit is not None and count >= limit:
                return
            count += 1
            yield found

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns") or ""
        parent_id = configurable.get("checkpoint_id")
        # a value of another type would be stored, then break every later read of the
        # thread (ids are compared and sorted as strings)
        _require_text(ns, "checkpoint_ns")
        _require_text(checkpoint["id"], "checkpoint id")
        if parent_id is not None:
            _require_text(parent_id, "checkpoint_id")
        entry = {
            "kind": "checkpoint",
            "ns": ns,
            "id": checkpoint["id"],
            "parent_id": parent_id,
            "checkpoint": self._dump(checkpoint),
            "metadata": self._dump(metadata),
        }
        await self._append(thread_id, entry)
        return {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint["id"],
            }
        }

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        configurable = config["configurable"]
        ns = configurable.get("checkpoint_ns") or ""
        _require_text(ns, "checkpoint_ns")
        _require_text(configurable["checkpoint_id"], "checkpoint_id")
        _require_text(task_id, "task_id")
        entry = {
            "kind": "writes",
            "ns": ns,
            "checkpoint_id": configurable["checkpoint_id"],
            "task_id": task_id,
            "task_path": task_path,
            "writes": [
                {
                    "idx": WRITES_IDX_MAP.get(channel, idx),
                    "channel": channel,
                    "value": self._dump(value),
                }
                for idx, (channel, value) in enumerate(writes)
            ],
        }
        await self._append(str(configurable["thread_id"]), entry)

    async def adelete_thread(self, thread_id: str) -> None:
        """Append a signed ``delete`` record: the thread's checkpoints and writes are no
        longer served; their records and digests stay in the ledger."""
        thread_id = str(thread_id)  # as every other method takes it (a UUID, say)
        if await self._verified(ledger_thread_id(thread_id)) is None:
            return
        await self._append(thread_id, {"kind": "delete"})

    # -- the sync API: the async one on the saver's loop -------------------------------

    def _sync(self, call: Any) -> Any:
        try:
            if asyncio.get_running_loop() is self.loop:
                call.close()
                raise asyncio.InvalidStateError(
                    "synchronous calls of ZtateCheckpointSaver must come from another thread "
                    "than its event loop's; use the async methods there"
                )
        except RuntimeError:
            pass
        if not self.loop.is_running() or self.loop.is_closed():
            call.close()
            raise asyncio.InvalidStateError(
                "synchronous calls of ZtateCheckpointSaver run on its event loop, which is "
                "not running: keep it running in another thread (it would wait forever)"
            )
        return asyncio.run_coroutine_threadsafe(call, self.loop).result()

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        found: CheckpointTuple | None = self._sync(self.aget_tuple(config))
        return found

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        async def collect() -> list[CheckpointTuple]:
            return [t async for t in self.alist(config, filter=filter, before=before, limit=limit)]

        found: list[CheckpointTuple] = self._sync(collect())
        yield from found

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        stored: RunnableConfig = self._sync(self.aput(config, checkpoint, metadata, new_versions))
        return stored

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self._sync(self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self._sync(self.adelete_thread(thread_id))
