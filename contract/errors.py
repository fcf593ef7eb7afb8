"""The contract's errors: bytes that do not meet a format.

Each error names the failed ``check`` (the names docs/verification.md defines, such
as ``receipt.signature`` or ``record.form``) and says how in ``message``, never with
key material or the content of a state value. The services translate them into their
own domain errors (``ztate.services.runtime.errors.from_contract``); the worker SDK
and the verifier report the check.
"""

from __future__ import annotations


class ContractError(ValueError):
    """Bytes, a value or a file that does not meet its format."""

    check: str = "form"

    def __init__(self, message: str, *, check: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if check is not None:
            self.check = check


class JsonMalformed(ContractError):
    """Not UTF-8, not JSON, not an object, a duplicate member name or a lone surrogate."""

    check = "json.malformed"


class JsonOutOfRange(ContractError):
    """A number outside I-JSON (RFC 7493) or nesting deeper than allowed."""

    check = "json.range"


class RecordInvalid(ContractError):
    """A ledger record that does not verify: digest, signature, form, place in the chain."""

    check = "record.form"


class ReceiptInvalid(ContractError):
    """An approval receipt whose signature, form or binding does not verify."""

    check = "receipt.form"


class ReceiptExpired(ReceiptInvalid):
    """A well-formed, well-signed receipt used outside its validity period."""

    check = "receipt.expired"


class CheckpointInvalid(ContractError):
    """A signed checkpoint whose signature or form does not verify."""

    check = "checkpoint.form"


class KeyFileError(ContractError):
    """An Ed25519 key file (signing key or public keyring) is unusable; the message
    never holds key material."""

    check = "keys"


class KeyringError(ContractError):
    """The HMAC keyring document is unusable; the message never holds key material."""

    check = "keyring"
