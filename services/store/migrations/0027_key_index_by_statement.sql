-- The key index is written once per statement, not once per ledger row (issue 19).
--
-- Every ledger row's changed keys go into ztate.transition_keys (migration 0007). A
-- row-level trigger did it: for each row a PL/pgSQL trigger call, an INSERT started
-- anew, and a call of ztate.patch_keys (another PL/pgSQL call, and its own query). A
-- `perf` profile of a backend running the group commit (the bench's 1 KB transition,
-- batches of three) put the trigger at 14 % of the backend's CPU, about 43 µs a row.
--
-- Now:
-- * ztate.patch_key_set(document) gives a record's (or a parked proposal's) changed
--   keys as a set: an SQL function whose body is one SELECT, which Postgres inlines into
--   the query that reads from it, when that query is planned (so not again at each call,
--   on any version). It is not STRICT, which would stop the inlining; a NULL document
--   gives no key either way. ztate.patch_keys, which the ledger queries call, is that set sorted
--   into an array, its result unchanged.
-- * ztate.index_transition_keys_of_statement(), an AFTER INSERT trigger FOR EACH
--   STATEMENT, reads the statement's new ledger rows from its transition table and
--   writes all their keys in one INSERT: one trigger call and one INSERT a batch.
--   Paired runs on one connection, a fresh database each (batches of three): 17 µs
--   less Postgres CPU a committed row (docs/performance.md, "Issue 19, seventh round").
--   The rows written are those the row trigger wrote.
--
-- On a database laid out for Citus (`ztate db citus` ran before this migration: its
-- key index has a thread_id column, distributed or not yet, should the distribution
-- have failed after the preparation) the row trigger stays as the layout made it: each
-- commit is one row there, and each shard's trigger writes the thread_id the
-- distributed key index needs. Only the functions are replaced; `ztate db citus` puts the row trigger (and its function) back
-- on a ledger it distributes later.

CREATE OR REPLACE FUNCTION ztate.patch_key_set(document bytea) RETURNS SETOF text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.jsonb_object_keys(
               pg_catalog.convert_from(document, 'UTF8')::jsonb -> 'patch')
$$;

CREATE OR REPLACE FUNCTION ztate.patch_keys(document bytea) RETURNS text[]
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN (SELECT coalesce(pg_catalog.array_agg(k ORDER BY k), '{}'::text[])
              FROM ztate.patch_key_set(document) AS k);
END;
$$;

CREATE OR REPLACE FUNCTION ztate.index_transition_keys_of_statement() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ztate.transition_keys (key, committed_at, digest, node_id)
    SELECT k, n.committed_at, n.digest, n.node_id
      FROM appended n, ztate.patch_key_set(n.record) AS k;
    RETURN NULL;
END;
$$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
                WHERE attrelid = 'ztate.transition_keys'::regclass AND attname = 'thread_id'
                  AND NOT attisdropped) THEN
        RETURN;  -- laid out for Citus (its key rows carry thread_id): the row trigger stays
    END IF;
    DROP TRIGGER IF EXISTS transitions_index_keys ON ztate.transitions;
    CREATE TRIGGER transitions_index_keys
        AFTER INSERT ON ztate.transitions
        REFERENCING NEW TABLE AS appended
        FOR EACH STATEMENT EXECUTE FUNCTION ztate.index_transition_keys_of_statement();
    DROP FUNCTION IF EXISTS ztate.index_transition_keys();  -- the row trigger's, unused now
END;
$$;
