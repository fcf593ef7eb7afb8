-- The outbox's receipts still to deliver, found by an index.
--
-- The delivery loop asks at every poll for the oldest receipts the transition service
-- has not taken (ztate.approval_service.store.UNDELIVERED: delivered_at IS NULL, in
-- (signed_at, digest) order, LIMIT). No index led there, so every poll read and sorted
-- every receipt ever signed, whatever the statistics, and the receipts are kept for
-- good. This index holds only the receipts not yet delivered, in the statement's order:
-- a poll reads those it returns. A receipt leaves it when its delivery is marked.

CREATE INDEX IF NOT EXISTS receipts_undelivered
    ON ztate_approval.receipts (signed_at, digest)
    WHERE delivered_at IS NULL;
