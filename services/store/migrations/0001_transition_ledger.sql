-- The transition service's tables: thread heads, the append-only ledger and the
-- rejections ledger. The service runs as the role :service_role, which may read
-- and append but never rewrite history.

CREATE SCHEMA IF NOT EXISTS ztate;

CREATE TABLE IF NOT EXISTS ztate.threads (
    thread_id     text PRIMARY KEY,
    version       bigint NOT NULL CHECK (version >= 0),
    head_digest   text NOT NULL CHECK (head_digest ~ '^[0-9a-f]{64}$'),
    -- the exact RFC 8785 bytes of the head state
    state         bytea NOT NULL,
    policy_name   text NOT NULL,
    policy_digest text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS ztate.transitions (
    thread_id       text NOT NULL REFERENCES ztate.threads (thread_id),
    version         bigint NOT NULL CHECK (version >= 0),
    digest          text NOT NULL UNIQUE CHECK (digest ~ '^[0-9a-f]{64}$'),
    parent_digest   text NOT NULL CHECK (parent_digest ~ '^[0-9a-f]{64}$'),
    node_id         text NOT NULL,
    key_id          text NOT NULL,
    signature       text NOT NULL CHECK (signature ~ '^[0-9a-f]{64}$'),
    -- the exact canonical bytes that were hashed: verification never re-canonicalises
    record          bytea NOT NULL,
    -- the state after this transition, in canonical bytes
    state           bytea NOT NULL,
    idempotency_key text,
    request_digest  text,
    committed_at    timestamptz NOT NULL,
    PRIMARY KEY (thread_id, version),
    -- two records with one parent would be a fork
    UNIQUE (thread_id, parent_digest)
);

CREATE UNIQUE INDEX IF NOT EXISTS transitions_idempotency
    ON ztate.transitions (thread_id, node_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE TABLE IF NOT EXISTS ztate.rejections (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rejected_at   timestamptz NOT NULL DEFAULT now(),
    method        text NOT NULL,
    node_id       text NOT NULL,
    thread_id     text,
    base_version  bigint,
    reason        text NOT NULL,
    keys          text[] NOT NULL DEFAULT '{}',
    -- a digest of the refused bytes, never the attacker's content itself
    patch_digest  text,
    patch_bytes   integer,
    message       text NOT NULL
);

CREATE INDEX IF NOT EXISTS rejections_by_thread ON ztate.rejections (thread_id, rejected_at);
CREATE INDEX IF NOT EXISTS rejections_by_node ON ztate.rejections (node_id, rejected_at);

-- History is append-only for every role, superusers included: repairs are new
-- transitions, never edits.
CREATE OR REPLACE FUNCTION ztate.refuse_history_rewrite() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ztate: % on %.% is refused: the ledger is append-only',
        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

DROP TRIGGER IF EXISTS transitions_append_only ON ztate.transitions;
CREATE TRIGGER transitions_append_only
    BEFORE UPDATE OR DELETE ON ztate.transitions
    FOR EACH ROW EXECUTE FUNCTION ztate.refuse_history_rewrite();
DROP TRIGGER IF EXISTS transitions_no_truncate ON ztate.transitions;
CREATE TRIGGER transitions_no_truncate
    BEFORE TRUNCATE ON ztate.transitions
    FOR EACH STATEMENT EXECUTE FUNCTION ztate.refuse_history_rewrite();

DROP TRIGGER IF EXISTS rejections_append_only ON ztate.rejections;
CREATE TRIGGER rejections_append_only
    BEFORE UPDATE OR DELETE ON ztate.rejections
    FOR EACH ROW EXECUTE FUNCTION ztate.refuse_history_rewrite();
DROP TRIGGER IF EXISTS rejections_no_truncate ON ztate.rejections;
CREATE TRIGGER rejections_no_truncate
    BEFORE TRUNCATE ON ztate.rejections
    FOR EACH STATEMENT EXECUTE FUNCTION ztate.refuse_history_rewrite();

-- Least privilege for the service role: read and append, move heads forward.
REVOKE ALL ON SCHEMA ztate FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA ztate FROM PUBLIC;
GRANT USAGE ON SCHEMA ztate TO :service_role;
GRANT SELECT, INSERT ON ztate.threads TO :service_role;
GRANT UPDATE (version, head_digest, state, updated_at) ON ztate.threads TO :service_role;
GRANT SELECT, INSERT ON ztate.transitions TO :service_role;
GRANT SELECT, INSERT ON ztate.rejections TO :service_role;
