-- Indexes for the operators' ledger queries (ListTransitions, KeyHistory), so that
-- a query on a million transitions answers in milliseconds. Pages are keyset
-- pages in (committed_at, digest) order, newest first, so every index ends with
-- those two columns.
--
-- The changed keys of a record are derived from its stored canonical bytes by
-- ztate.patch_keys. Filtering "newest first, touching key K" needs an index
-- ordered by time per key: a GIN index on the keys cannot give that order, and
-- walking the time index while parsing each record costs a scan of the whole
-- ledger when K was last touched long ago. So an insert trigger writes one small
-- row per changed key into ztate.transition_keys, whose primary key is exactly
-- that order. It is derived data: the verifier never reads it.

-- The top-level keys a record's (or a parked proposal's) "patch" touches, sorted.
-- IMMUTABLE is true here: the bytes are canonical UTF-8 JSON written once, and
-- the result depends on nothing but them.
CREATE OR REPLACE FUNCTION ztate.patch_keys(document bytea) RETURNS text[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT coalesce(pg_catalog.array_agg(k ORDER BY k), '{}'::text[])
      FROM pg_catalog.jsonb_object_keys(
               pg_catalog.convert_from(document, 'UTF8')::jsonb -> 'patch') AS k
$$;

CREATE INDEX IF NOT EXISTS transitions_by_time
    ON ztate.transitions (committed_at DESC, digest DESC);
CREATE INDEX IF NOT EXISTS transitions_by_node
    ON ztate.transitions (node_id, committed_at DESC, digest DESC);
CREATE INDEX IF NOT EXISTS transitions_by_thread_time
    ON ztate.transitions (thread_id, committed_at DESC, digest DESC);

CREATE TABLE IF NOT EXISTS ztate.transition_keys (
    key          text NOT NULL,
    committed_at timestamptz NOT NULL,
    -- no foreign key: tamper tests and repairs by a superuser must stay possible
    digest       text NOT NULL,
    node_id      text NOT NULL,
    PRIMARY KEY (key, committed_at, digest)
);

CREATE OR REPLACE FUNCTION ztate.index_transition_keys() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ztate.transition_keys (key, committed_at, digest, node_id)
    SELECT k, NEW.committed_at, NEW.digest, NEW.node_id
      FROM pg_catalog.unnest(ztate.patch_keys(NEW.record)) AS k;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS transitions_index_keys ON ztate.transitions;
CREATE TRIGGER transitions_index_keys
    AFTER INSERT ON ztate.transitions
    FOR EACH ROW EXECUTE FUNCTION ztate.index_transition_keys();

-- the ledger as it stands when this migration runs
INSERT INTO ztate.transition_keys (key, committed_at, digest, node_id)
SELECT k, t.committed_at, t.digest, t.node_id
  FROM ztate.transitions t, pg_catalog.unnest(ztate.patch_keys(t.record)) AS k
    ON CONFLICT DO NOTHING;

DROP TRIGGER IF EXISTS transition_keys_append_only ON ztate.transition_keys;
CREATE TRIGGER transition_keys_append_only
    BEFORE UPDATE OR DELETE ON ztate.transition_keys
    FOR EACH ROW EXECUTE FUNCTION ztate.refuse_history_rewrite();
DROP TRIGGER IF EXISTS transition_keys_no_truncate ON ztate.transition_keys;
CREATE TRIGGER transition_keys_no_truncate
    BEFORE TRUNCATE ON ztate.transition_keys
    FOR EACH STATEMENT EXECUTE FUNCTION ztate.refuse_history_rewrite();

CREATE INDEX IF NOT EXISTS pending_by_status_time
    ON ztate.pending_transitions (status, parked_at DESC, digest DESC);

REVOKE ALL ON ztate.transition_keys FROM PUBLIC;
-- the service's commits fill it through the trigger, which runs as the service
GRANT INSERT ON ztate.transition_keys TO :service_role;
GRANT SELECT ON ztate.transition_keys TO :reader_role;
-- EXECUTE on ztate.patch_keys stays granted to PUBLIC (the default).
