-- The outbox's receipts still to deliver, found by an index.
--
-- The delivery loop asks at every poll for the oldest receipts the transition service
-- has not taken (ztate.approval_service.store.UNDELIVERED: delivered_at IS NULL, in
-- (signed_at, digest) order, LIMIT). No index led there, so every poll read and sorted
-- every receipt ever signed, whatever the statistics, and the receipts are kept for
-- good. This index holds only the receipts not yet delivered, in the statement's order:
-- a poll reads those it returns. A receipt leaves it when its delivery is marked.
--
-- Building it reads the receipts once and blocks their inserts and delivery marks while
-- it runs (approvals wait); on a very large table create it first with
-- CREATE INDEX CONCURRENTLY under this name, and this migration finds it there. A
-- concurrent build that failed leaves an invalid index of that name, which the planner
-- never uses: this migration then fails, naming it (drop it, build it again, migrate
-- again).

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_index
                WHERE indexrelid = pg_catalog.to_regclass('ztate_approval.receipts_undelivered')
                  AND NOT (indisvalid AND indisready)) THEN
        RAISE EXCEPTION 'the index ztate_approval.receipts_undelivered exists but is not '
            'valid (a CREATE INDEX CONCURRENTLY that failed?): drop it, then migrate again';
    END IF;
    CREATE INDEX IF NOT EXISTS receipts_undelivered
        ON ztate_approval.receipts (signed_at, digest)
        WHERE delivered_at IS NULL;
END;
$$;
