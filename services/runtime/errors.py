"""Domain errors: one type per failure, each with one reason code.

The reason names are those of ``ztate.v1.ErrorReason`` without its prefix; a unit
test keeps the two in step. How each maps to a gRPC status lives in
``ztate.services.runtime.rpc_errors`` and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable

from ztate.contract import errors as contract

MAX_NAMED_KEYS = 32
"""A refusal names at most this many keys (sorted, the first ones) and counts all:
every error detail, trailer and rejection row stays small whatever the patch held."""


def named(keys: Iterable[str]) -> str:
    """Keys for a message: the first ``MAX_NAMED_KEYS`` and how many more there are."""
    listed = sorted(keys)
    more = len(listed) - MAX_NAMED_KEYS
    shown = str(listed[:MAX_NAMED_KEYS])
    return f"{shown} and {more} more" if more > 0 else shown


class ZtateError(Exception):
    """Base of every refusal ztate reports to a caller.

    ``message`` is shown to the caller, so it must never hold secrets or the
    content of state values.
    """

    reason: str = "UNSPECIFIED"
    # its rejection row was written by the statement that found it (the store's
    # head_for_request), so the service writes no second one
    recorded: bool = False

    def __init__(
        self,
        message: str,
        *,
        keys: Iterable[str] = (),
        current_version: int | None = None,
        limit: int | None = None,
        rules: Iterable[str] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        every = sorted(keys)
        self.keys: tuple[str, ...] = tuple(every[:MAX_NAMED_KEYS])
        self.keys_total = len(every)
        self.current_version = current_version
        self.limit = limit
        self.rules: tuple[str, ...] = tuple(rules)


class IdentityInvalid(ZtateError):
    reason = "IDENTITY_INVALID"


class IdentityRevoked(ZtateError):
    """The caller's certificate, or its whole identity, is in the revocation list
    (``ztate.services.runtime.revocation``): TLS accepted it, ztate no longer does."""

    reason = "IDENTITY_REVOKED"


class CertificateExpired(ZtateError):
    """The caller's certificate is outside its validity period on a connection TLS
    accepted while it was valid (TLS checks the dates at the handshake only)."""

    reason = "CERTIFICATE_EXPIRED"


class RoleForbidden(ZtateError):
    reason = "ROLE_FORBIDDEN"


class NodeNotRegistered(ZtateError):
    reason = "NODE_NOT_REGISTERED"


class KeyNotWritable(ZtateError):
    reason = "KEY_NOT_WRITABLE"


class PatchTooLarge(ZtateError):
    reason = "PATCH_TOO_LARGE"


class PatchMalformed(ZtateError):
    reason = "PATCH_MALFORMED"


class StateTooLarge(ZtateError):
    """The state a patch (or revert, or initial state) would make is over
    ``ZTATE_MAX_STATE_BYTES``: past it, the thread could no longer be read."""

    reason = "STATE_TOO_LARGE"


class UnsupportedCharacter(ZtateError):
    """Valid I-JSON that PostgreSQL cannot store: U+0000 in a string or member name."""

    reason = "UNSUPPORTED_CHARACTER"


class ValueOutOfRange(ZtateError):
    reason = "VALUE_OUT_OF_RANGE"


class StaleVersion(ZtateError):
    reason = "STALE_VERSION"


class ThreadNotFound(ZtateError):
    reason = "THREAD_NOT_FOUND"


class ThreadExists(ZtateError):
    reason = "THREAD_EXISTS"


class TransitionNotFound(ZtateError):
    reason = "TRANSITION_NOT_FOUND"


class IdempotencyKeyReused(ZtateError):
    reason = "IDEMPOTENCY_KEY_REUSED"


class RequestInvalid(ZtateError):
    reason = "REQUEST_INVALID"


class KeyUnknown(ZtateError):
    reason = "KEY_UNKNOWN"


class StorageUnavailable(ZtateError):
    reason = "STORAGE_UNAVAILABLE"


class SchemaViolation(ZtateError):
    reason = "SCHEMA_VIOLATION"


class LayerViolation(ZtateError):
    reason = "LAYER_VIOLATION"


class InvariantViolated(ZtateError):
    reason = "INVARIANT_VIOLATED"


class CredentialDetected(ZtateError):
    reason = "CREDENTIAL_DETECTED"


class PolicyNotFound(ZtateError):
    reason = "POLICY_NOT_FOUND"


class PolicyMismatch(ZtateError):
    reason = "POLICY_MISMATCH"


class ReceiptInvalid(ZtateError):
    reason = "RECEIPT_INVALID"


class ReceiptMismatch(ZtateError):
    reason = "RECEIPT_MISMATCH"


class ReceiptExpired(ZtateError):
    reason = "RECEIPT_EXPIRED"


class ReceiptReplayed(ZtateError):
    reason = "RECEIPT_REPLAYED"


class ApprovalStale(ZtateError):
    reason = "APPROVAL_STALE"


class ReviewNotFound(ZtateError):
    reason = "REVIEW_NOT_FOUND"


class ReviewClosed(ZtateError):
    reason = "REVIEW_CLOSED"


class SelfApproval(ZtateError):
    reason = "SELF_APPROVAL"


class AlreadyDecided(ZtateError):
    reason = "ALREADY_DECIDED"


class StatePruned(ZtateError):
    reason = "STATE_PRUNED"


class TooManyStreams(ZtateError):
    reason = "TOO_MANY_STREAMS"


class LeaseLost(ZtateError):
    """The lease grant named (its epoch) no longer holds the thread: it lapsed
    (whether or not another process of the node took it since; migration 0028), or it
    was released. Says nothing of whether the thread exists."""

    reason = "LEASE_LOST"


class NoWakeDeclared(ZtateError):
    """The node's policy declares no wake for it: the server never has work for it."""

    reason = "NO_WAKE_DECLARED"


class QueryTooCostly(ZtateError):
    """A ledger query ran past the reader's statement timeout (``limit``, in
    milliseconds), or the database's operator cancelled it: narrow it and ask again."""

    reason = "QUERY_TOO_COSTLY"


ALL_ERRORS: tuple[type[ZtateError], ...] = tuple(ZtateError.__subclasses__())

_FROM_CONTRACT: tuple[tuple[type[contract.ContractError], type[ZtateError]], ...] = (
    (contract.JsonMalformed, PatchMalformed),
    (contract.JsonOutOfRange, ValueOutOfRange),
    (contract.ReceiptExpired, ReceiptExpired),  # before its base class, ReceiptInvalid
    (contract.ReceiptInvalid, ReceiptInvalid),
)


def from_contract(error: contract.ContractError) -> ZtateError:
    """The domain error a caller is told for bytes it sent that miss their format
    (``ztate.contract``): a patch or state that is not I-JSON, a receipt that does not
    verify. Any other contract error is a request the service cannot use."""
    for contract_type, domain_type in _FROM_CONTRACT:
        if isinstance(error, contract_type):
            return domain_type(error.message)
    return RequestInvalid(error.message)
