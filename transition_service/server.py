"""The gRPC face of the transition pipeline (``ztate.v1.TransitionService``).

Every handler runs behind ``guarded``, which authenticates the caller and maps
refusals to gRPC statuses.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf import timestamp_pb2

from ztate.contract.receipts import SignedReceipt
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Authenticator, Identity
from ztate.services.runtime.rpc_guard import Context, failure_status, guarded
from ztate.services.store.rows import PendingTransition, StoredTransition
from ztate.transition_service.decisions import (
    DecisionPipeline,
    Resolution,
    WaitFor,
    pending_handle,
)
from ztate.transition_service.ledger_server import timestamp_message
from ztate.transition_service.pipeline import TransitionPipeline
from ztate.transition_service.reads import Lookup, RecordWithEvidence, ThreadReads
from ztate.transition_service.requests import Outcome, Parked, Proposal, Revert
from ztate.transition_service.watch import Subscription, Watcher
from ztate.transition_service.work import Leases, Work, WorkStream
from ztate.v1 import approval_pb2, transition_pb2, transition_pb2_grpc

log = logging.getLogger("ztate.rpc")


def transition_message(stored: StoredTransition, *, disclose: bool) -> transition_pb2.Transition:
    """A committed record; without ``disclose``, its version and metadata only (no record
    and no digest: each commits to the whole state, keys the caller may not read included)."""
    committed_at = timestamp_message(stored.committed_at)
    message = transition_pb2.Transition(
        thread_id=stored.thread_id,
        version=stored.version,
        key_id=stored.key_id,
        node_id=stored.node_id,
        committed_at=committed_at,
    )
    if disclose:
        message.digest = stored.digest
        message.parent_digest = stored.parent_digest
        message.signature = stored.signature
        message.record_json = stored.record
    return message


def pending_message(
    pending: PendingTransition, *, disclose: bool
) -> transition_pb2.PendingTransition:
    """A parked proposal; without ``disclose``, no digest, proposal or matched rules (a
    rule may test keys the caller may not read), only what names it for WaitForOutcome."""
    parked_at = timestamp_message(pending.parked_at)
    message = transition_pb2.PendingTransition(
        thread_id=pending.thread_id,
        base_version=pending.base_version,
        parked_at=parked_at,
        handle=pending_handle(pending.thread_id, pending.idempotency_key),
    )
    if disclose:
        message.digest = pending.digest
        message.risk_rules.extend(pending.risk_rules)
        message.proposal_json = pending.proposal
    return message


class TransitionServicer(transition_pb2_grpc.TransitionServiceServicer):
    """Adapts ``TransitionPipeline`` to ``ztate.v1.TransitionService``."""

    def __init__(
        self,
        pipeline: TransitionPipeline,
        decisions: DecisionPipeline,
        authenticator: Authenticator,
        reads: ThreadReads,
        watcher: Watcher,
        work: Work | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._decisions = decisions
        self._authenticator = authenticator
        self._reads = reads
        self._watcher = watcher
        self._work = work

    async def CreateThread(
        self, request: transition_pb2.CreateThreadRequest, context: Context
    ) -> transition_pb2.CreateThreadResponse:
        async def handle(caller: Identity) -> transition_pb2.CreateThreadResponse:
            created = await self._pipeline.create_thread(
                caller, request.thread_id, request.policy, request.initial_state_json
            )
            return transition_pb2.CreateThreadResponse(
                genesis=transition_message(created.transition, disclose=True),
                replayed=created.replayed,
            )

        return await guarded(context, self._authenticator, "CreateThread", handle)

    async def GetView(
        self, request: transition_pb2.GetViewRequest, context: Context
    ) -> transition_pb2.GetViewResponse:
        async def handle(caller: Identity) -> transition_pb2.GetViewResponse:
            view = await self._pipeline.view(caller, request.thread_id)
            return transition_pb2.GetViewResponse(
                thread_id=view.thread_id,
                version=view.version,
                state_json=view.state_json,
                head_digest=view.head_digest if self._reads.discloses_records(caller) else "",
            )

        return await guarded(context, self._authenticator, "GetView", handle)

    async def ProposeTransition(
        self, request: transition_pb2.ProposeTransitionRequest, context: Context
    ) -> transition_pb2.ProposeTransitionResponse:
        proposal = Proposal(
            thread_id=request.thread_id,
            expected_version=request.expected_version,
            patch_json=request.patch_json,
            idempotency_key=request.idempotency_key,
        )

        async def handle(caller: Identity) -> transition_pb2.ProposeTransitionResponse:
            if request.lease_epoch and self._work is not None:
                outcome = await propose_leased(
                    self._pipeline, self._work.leases, caller, proposal, request.lease_epoch
                )
            else:
                outcome = await self._pipeline.propose(caller, proposal)
            disclose = self._reads.discloses_records(caller)
            if isinstance(outcome, Parked):
                return transition_pb2.ProposeTransitionResponse(
                    pending=pending_message(outcome.pending, disclose=disclose),
                    replayed=outcome.replayed,
                )
            return transition_pb2.ProposeTransitionResponse(
                transition=transition_message(outcome.transition, disclose=disclose),
                replayed=outcome.replayed,
            )

        async def revoked(
            caller: Identity, refusal: errors.IdentityRevoked | errors.CertificateExpired
        ) -> None:
            await self._pipeline.refused(caller, proposal, refusal)  # its rejection row

        return await guarded(
            context, self._authenticator, "ProposeTransition", handle, on_revoked=revoked
        )

    async def GetTransition(
        self, request: transition_pb2.GetTransitionRequest, context: Context
    ) -> transition_pb2.GetTransitionResponse:
        async def handle(caller: Identity) -> transition_pb2.GetTransitionResponse:
            lookup = request.WhichOneof("lookup")
            found = await self._reads.transition(
                caller,
                Lookup(
                    digest=request.digest if lookup == "digest" else None,
                    thread_id=(
                        request.thread_version.thread_id if lookup == "thread_version" else None
                    ),
                    version=request.thread_version.version if lookup == "thread_version" else None,
                    head_of=request.head_of_thread if lookup == "head_of_thread" else None,
                ),
            )
            return evidence_message(found)

        return await guarded(context, self._authenticator, "GetTransition", handle)

    async def GetCheckpoint(
        self, request: transition_pb2.GetCheckpointRequest, context: Context
    ) -> transition_pb2.GetCheckpointResponse:
        async def handle(caller: Identity) -> transition_pb2.GetCheckpointResponse:
            found = await self._reads.checkpoint(caller, request.thread_id)
            if found is None:
                return transition_pb2.GetCheckpointResponse()
            return transition_pb2.GetCheckpointResponse(
                checkpoint=transition_pb2.SignedCheckpoint(
                    checkpoint_json=found.checkpoint,
                    signature=found.signature,
                    key_id=found.key_id,
                )
            )

        return await guarded(context, self._authenticator, "GetCheckpoint", handle)

    def _still_valid(self, context: Context, caller: Identity) -> Callable[[], None]:
        """The check a stream runs before each message: the caller's certificate still in
        its validity period, neither it nor its identity revoked (the list as it is
        then), as a call is checked when it starts."""
        auth = context.auth_context()
        authenticator = self._authenticator

        def check() -> None:
            authenticator.check_credential(context, caller, auth)

        return check

    async def WatchThread(
        self, request: transition_pb2.WatchThreadRequest, context: Context
    ) -> AsyncIterator[transition_pb2.WatchThreadResponse]:
        async def handle(caller: Identity) -> Subscription:
            return await self._watcher.open(caller, request.thread_id, request.from_version)

        subscription = await guarded(context, self._authenticator, "WatchThread", handle)
        disclose = self._reads.discloses_records(subscription.caller)
        still_valid = self._still_valid(context, subscription.caller)
        try:
            async for version in subscription:
                still_valid()  # a certificate expired or revoked since: no more state
                yield transition_pb2.WatchThreadResponse(
                    thread_id=version.thread_id,
                    version=version.version,
                    digest=version.digest if disclose else "",
                    state_json=version.state_json,
                    state_pruned=version.state_pruned,
                )
        except Exception as failure:
            # mid-stream, grpc's default handler would send the exception's text
            # (possibly state) to the node as UNKNOWN: answer as every handler does
            status = failure_status("WatchThread", failure)
            await context.abort(status.code, status.details, status.trailing_metadata)
        finally:
            await subscription.close()

    async def ApplyDecision(
        self, request: transition_pb2.ApplyDecisionRequest, context: Context
    ) -> transition_pb2.ApplyDecisionResponse:
        async def handle(caller: Identity) -> transition_pb2.ApplyDecisionResponse:
            receipt = request.receipt
            resolution = await self._decisions.apply(
                caller, SignedReceipt(receipt.receipt_json, receipt.signature, receipt.key_id)
            )
            return transition_pb2.ApplyDecisionResponse(
                **resolution_fields(resolution, disclose=True)
            )

        return await guarded(context, self._authenticator, "ApplyDecision", handle)

    async def WaitForOutcome(
        self, request: transition_pb2.WaitForOutcomeRequest, context: Context
    ) -> transition_pb2.WaitForOutcomeResponse:
        async def handle(caller: Identity) -> transition_pb2.WaitForOutcomeResponse:
            remaining = context.time_remaining()
            # Answer a little before the caller's deadline, so the answer arrives.
            patience = None if remaining is None else max(remaining - 0.2, 0.0)
            disclose = self._reads.discloses_records(caller)
            if request.digest and not disclose:
                # probing digests would confirm guesses of keys it may not read
                raise errors.RoleForbidden("this node names its parked proposals by handle")
            resolution = await self._decisions.wait(
                caller, WaitFor(digest=request.digest, handle=request.handle), patience
            )
            return transition_pb2.WaitForOutcomeResponse(
                **resolution_fields(resolution, disclose=disclose)
            )

        return await guarded(context, self._authenticator, "WaitForOutcome", handle)

    async def RevertThread(
        self, request: transition_pb2.RevertThreadRequest, context: Context
    ) -> transition_pb2.RevertThreadResponse:
        async def handle(caller: Identity) -> transition_pb2.RevertThreadResponse:
            outcome = await self._pipeline.revert(
                caller,
                Revert(
                    thread_id=request.thread_id,
                    to_version=request.to_version,
                    idempotency_key=request.idempotency_key,
                ),
            )
            return transition_pb2.RevertThreadResponse(
                transition=transition_message(outcome.transition, disclose=True),
                replayed=outcome.replayed,
            )

        return await guarded(context, self._authenticator, "RevertThread", handle)

    async def SubscribeWork(
        self, request: transition_pb2.SubscribeWorkRequest, context: Context
    ) -> AsyncIterator[transition_pb2.SubscribeWorkResponse]:
        work = self._work

        async def handle(caller: Identity) -> WorkStream:
            if work is None:
                raise errors.NoWakeDeclared("this server hands out no work")
            return work.dispatcher.open(caller, request.max_in_flight)

        stream = await guarded(context, self._authenticator, "SubscribeWork", handle)
        assert work is not None
        still_valid = self._still_valid(context, stream.caller)
        try:
            async for item in work.dispatcher.items(stream):
                try:
                    still_valid()
                except errors.ZtateError:
                    # a certificate expired or revoked since: no more state, no more
                    # leases; the one granted for this item goes back undone at once
                    await work.dispatcher.give_back(stream, item)
                    raise
                expires = timestamp_message(item.expires_at)
                yield transition_pb2.SubscribeWorkResponse(
                    thread_id=item.thread_id,
                    version=item.version,
                    state_json=item.state_json,
                    lease_epoch=item.epoch,
                    lease_expires_at=expires,
                    lease_ttl_seconds=item.ttl,
                    head_digest=item.head_digest,
                )
        except Exception as failure:
            status = failure_status("SubscribeWork", failure)
            await context.abort(status.code, status.details, status.trailing_metadata)
        finally:
            work.dispatcher.close(stream)

    async def RenewLease(
        self, request: transition_pb2.RenewLeaseRequest, context: Context
    ) -> transition_pb2.RenewLeaseResponse:
        async def handle(caller: Identity) -> transition_pb2.RenewLeaseResponse:
            if self._work is None:
                raise errors.LeaseLost("this lease is no longer held")
            expires = await self._work.leases.renew(caller, request.thread_id, request.lease_epoch)
            stamp = timestamp_pb2.Timestamp()
            stamp.FromDatetime(expires)
            return transition_pb2.RenewLeaseResponse(lease_expires_at=stamp)

        return await guarded(context, self._authenticator, "RenewLease", handle)

    async def ReleaseLease(
        self, request: transition_pb2.ReleaseLeaseRequest, context: Context
    ) -> transition_pb2.ReleaseLeaseResponse:
        async def handle(caller: Identity) -> transition_pb2.ReleaseLeaseResponse:
            if self._work is None:
                raise errors.LeaseLost("this lease is no longer held")
            await self._work.leases.release(
                caller, request.thread_id, request.lease_epoch, request.handled_version
            )
            return transition_pb2.ReleaseLeaseResponse()

        return await guarded(context, self._authenticator, "ReleaseLease", handle)


async def propose_leased(
    pipeline: TransitionPipeline,
    leases: Leases,
    caller: Identity,
    proposal: Proposal,
    epoch: int,
) -> Outcome:
    """A proposal under lease grant ``epoch`` (a SubscribeWork worker's): refused with
    ``LeaseLost`` (its rejection row recorded) when the grant no longer holds the lease;
    once answered, the lease goes back, the node done with the version it built on. On
    the happy path, one round trip: the commit fences and releases the lease itself
    (migration 0019; docs/work.md, "Proposals under a lease")."""
    try:
        lease = leases.claim(caller, proposal.thread_id, epoch)
    except errors.ZtateError as refusal:
        await pipeline.refused(caller, proposal, refusal)
        raise
    outcome = await pipeline.propose(caller, proposal, lease)
    await leases.finish(lease, proposal.expected_version)
    return outcome


def evidence_message(found: RecordWithEvidence) -> transition_pb2.GetTransitionResponse:
    # only operators and read_records nodes get this far (ThreadReads.transition)
    response = transition_pb2.GetTransitionResponse(
        transition=transition_message(found.transition, disclose=True)
    )
    evidence = found.evidence
    if evidence.receipt is not None:
        response.receipt.CopyFrom(
            approval_pb2.SignedReceipt(
                receipt_json=evidence.receipt,
                signature=evidence.receipt_signature or "",
                key_id=evidence.receipt_key_id or "",
            )
        )
        response.risk_rules.extend(evidence.risk_rules)
    return response


def resolution_fields(resolution: Resolution, *, disclose: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "outcome": transition_pb2.Outcome.Value(f"OUTCOME_{resolution.outcome.name}")
    }
    if resolution.transition is not None:
        fields["transition"] = transition_message(resolution.transition, disclose=disclose)
    if resolution.reason is not None:
        fields["reason"] = resolution.reason
    return fields
