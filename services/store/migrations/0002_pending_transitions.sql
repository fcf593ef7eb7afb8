-- Proposals that matched a risk rule wait here for a human decision. They are
-- not state: nothing reads them as memory, and committing one is a new
-- transition in the ledger.

CREATE TABLE IF NOT EXISTS ztate.pending_transitions (
    digest          text PRIMARY KEY CHECK (digest ~ '^[0-9a-f]{64}$'),
    thread_id       text NOT NULL REFERENCES ztate.threads (thread_id),
    base_version    bigint NOT NULL CHECK (base_version >= 0),
    parent_digest   text NOT NULL CHECK (parent_digest ~ '^[0-9a-f]{64}$'),
    node_id         text NOT NULL,
    -- the exact canonical bytes that were hashed into digest
    proposal        bytea NOT NULL,
    -- the candidate state, in canonical bytes
    state           bytea NOT NULL,
    risk_rules      text[] NOT NULL,
    idempotency_key text NOT NULL,
    request_digest  text NOT NULL,
    status          text NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'committed', 'rejected', 'expired', 'stale')),
    parked_at       timestamptz NOT NULL,
    UNIQUE (thread_id, node_id, idempotency_key)
);

CREATE INDEX IF NOT EXISTS pending_by_thread ON ztate.pending_transitions (thread_id, status);

-- Parked proposals are evidence too: only their status may ever change.
CREATE OR REPLACE FUNCTION ztate.pending_status_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR (to_jsonb(NEW) - 'status') <> (to_jsonb(OLD) - 'status') THEN
        RAISE EXCEPTION 'ztate: only the status of a pending transition may change'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS pending_transitions_status_only ON ztate.pending_transitions;
CREATE TRIGGER pending_transitions_status_only
    BEFORE UPDATE OR DELETE ON ztate.pending_transitions
    FOR EACH ROW EXECUTE FUNCTION ztate.pending_status_only();
DROP TRIGGER IF EXISTS pending_transitions_no_truncate ON ztate.pending_transitions;
CREATE TRIGGER pending_transitions_no_truncate
    BEFORE TRUNCATE ON ztate.pending_transitions
    FOR EACH STATEMENT EXECUTE FUNCTION ztate.refuse_history_rewrite();

REVOKE ALL ON ztate.pending_transitions FROM PUBLIC;
GRANT SELECT, INSERT ON ztate.pending_transitions TO :service_role;
GRANT UPDATE (status) ON ztate.pending_transitions TO :service_role;
