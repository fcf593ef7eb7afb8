"""Ed25519-signed canonical JSON objects: receipts and checkpoints are both one.

The order is the rule: the signature is checked over the exact bytes first, and only
then are they parsed, so nothing unsigned is ever interpreted; the bytes must be the
RFC 8785 form of an object with exactly the format's members.
"""

from __future__ import annotations

import json
import re

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ztate.contract.canonical import JsonObject, canonical_or_error
from ztate.contract.errors import ContractError
from ztate.contract.record import shown

SIGNATURE_HEX = re.compile(r"[0-9a-f]{128}")


def signed_object(
    data: bytes,
    signature: str,
    key_id: str,
    public_keys: dict[str, Ed25519PublicKey],
    *,
    what: str,
    signer: str,
    members: frozenset[str],
    error: type[ContractError],
) -> JsonObject:
    """``data`` parsed, once its Ed25519 ``signature`` verifies under ``public_keys[key_id]``
    and it is the canonical form of an object with exactly ``members``. Raises ``error``
    with check ``<what>.signature`` (no such key, a signature that does not verify) or
    ``<what>.form``; messages name ``what`` (``receipt``) and ``signer`` (``approval``)."""
    key = public_keys.get(key_id)
    if key is None:
        raise error(f"no {signer} public key has id {shown(key_id)}", check=f"{what}.signature")
    # one way of writing a signature, as ztate writes it: bytes.fromhex also takes upper
    # case and whitespace, which the TypeScript verifier (rightly) refuses
    try:
        if not isinstance(signature, str) or not SIGNATURE_HEX.fullmatch(signature):
            raise InvalidSignature
        key.verify(bytes.fromhex(signature), data)
    except (InvalidSignature, ValueError, TypeError):
        raise error(
            f"the {what}'s Ed25519 signature does not verify", check=f"{what}.signature"
        ) from None
    form = f"{what}.form"
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise error(f"the {what} is not JSON", check=form) from None
    if not isinstance(body, dict) or body.keys() != members:
        raise error(f"the {what} does not have the members of format 1", check=form)
    # True == 1 in Python: a format of true would pass every caller's comparison
    if type(body.get("format")) is not int:
        raise error(f"the {what}'s format is not an integer", check=form)
    if canonical_or_error(body, error, form) != data:
        raise error(f"the {what} is not in canonical (RFC 8785) form", check=form)
    return body
