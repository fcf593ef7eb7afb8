-- Signed checkpoints of thread heads (Ed25519), so that the chain can be checked
-- with public keys alone. Append-only like the ledger.

CREATE TABLE IF NOT EXISTS ztate.checkpoints (
    thread_id   text NOT NULL REFERENCES ztate.threads (thread_id),
    version     bigint NOT NULL CHECK (version >= 0),
    head_digest text NOT NULL CHECK (head_digest ~ '^[0-9a-f]{64}$'),
    checkpoint  bytea NOT NULL,
    signature   text NOT NULL,
    key_id      text NOT NULL,
    signed_at   timestamptz NOT NULL,
    PRIMARY KEY (thread_id, version)
);

DROP TRIGGER IF EXISTS checkpoints_append_only ON ztate.checkpoints;
CREATE TRIGGER checkpoints_append_only
    BEFORE UPDATE OR DELETE ON ztate.checkpoints
    FOR EACH ROW EXECUTE FUNCTION ztate.refuse_history_rewrite();
DROP TRIGGER IF EXISTS checkpoints_no_truncate ON ztate.checkpoints;
CREATE TRIGGER checkpoints_no_truncate
    BEFORE TRUNCATE ON ztate.checkpoints
    FOR EACH STATEMENT EXECUTE FUNCTION ztate.refuse_history_rewrite();

REVOKE ALL ON ztate.checkpoints FROM PUBLIC;
GRANT SELECT, INSERT ON ztate.checkpoints TO :service_role;
GRANT SELECT ON ztate.checkpoints TO :reader_role;
