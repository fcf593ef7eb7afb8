-- Approvals: parked transitions are submitted to the approval service (an
-- outbox), and every receipt the transition service applies is kept, so that a
-- nonce can never be used twice, even after a restart, and the verifier can
-- check each receipt later.

ALTER TABLE ztate.transitions
    ADD COLUMN IF NOT EXISTS receipt bytea,
    ADD COLUMN IF NOT EXISTS receipt_signature text,
    ADD COLUMN IF NOT EXISTS receipt_key_id text;

ALTER TABLE ztate.pending_transitions
    ADD COLUMN IF NOT EXISTS redacted_diff bytea,
    ADD COLUMN IF NOT EXISTS required_approvals integer NOT NULL DEFAULT 1
        CHECK (required_approvals >= 1),
    ADD COLUMN IF NOT EXISTS submitted_at timestamptz,
    ADD COLUMN IF NOT EXISTS decided_at timestamptz;

CREATE INDEX IF NOT EXISTS pending_to_submit ON ztate.pending_transitions (parked_at)
    WHERE submitted_at IS NULL AND status = 'pending';

-- Only the status, and the moments it was submitted and decided, may change.
CREATE OR REPLACE FUNCTION ztate.pending_status_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR (to_jsonb(NEW) - 'status' - 'submitted_at' - 'decided_at')
                           <> (to_jsonb(OLD) - 'status' - 'submitted_at' - 'decided_at') THEN
        RAISE EXCEPTION 'ztate: only the status of a pending transition may change'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF OLD.status <> 'pending' AND NEW.status <> OLD.status THEN
        RAISE EXCEPTION 'ztate: a decided pending transition stays decided'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TABLE IF NOT EXISTS ztate.receipts (
    receipt_digest    text PRIMARY KEY CHECK (receipt_digest ~ '^[0-9a-f]{64}$'),
    transition_digest text NOT NULL REFERENCES ztate.pending_transitions (digest),
    decision          text NOT NULL CHECK (decision IN ('approve', 'reject')),
    -- a nonce authorises once, ever
    nonce             text NOT NULL UNIQUE,
    receipt           bytea NOT NULL,
    signature         text NOT NULL,
    key_id            text NOT NULL,
    applied_at        timestamptz NOT NULL DEFAULT now()
);

DROP TRIGGER IF EXISTS receipts_append_only ON ztate.receipts;
CREATE TRIGGER receipts_append_only
    BEFORE UPDATE OR DELETE ON ztate.receipts
    FOR EACH ROW EXECUTE FUNCTION ztate.refuse_history_rewrite();
DROP TRIGGER IF EXISTS receipts_no_truncate ON ztate.receipts;
CREATE TRIGGER receipts_no_truncate
    BEFORE TRUNCATE ON ztate.receipts
    FOR EACH STATEMENT EXECUTE FUNCTION ztate.refuse_history_rewrite();

REVOKE ALL ON ztate.receipts FROM PUBLIC;
GRANT SELECT, INSERT ON ztate.receipts TO :service_role;
GRANT UPDATE (submitted_at, decided_at) ON ztate.pending_transitions TO :service_role;
GRANT SELECT ON ztate.receipts TO :reader_role;
