-- The changed keys of a record are computed by a function whose plan is kept (issue 19).
--
-- ztate.patch_keys (migration 0007) was an SQL-language function. Postgres inlines an SQL
-- function only when its body is a bare expression; this one reads from
-- jsonb_object_keys and aggregates, and Postgres before 18 plans the body of such a
-- function again at every call that starts a new query. The key-index trigger fires once
-- per ledger row, a new query each time: on Postgres 15 (Debian's, and the Citus lane's)
-- the 7,038 calls of a 10 s end-to-end run planned it 7,038 times, 33 µs of planning and
-- 47 µs of execution a call (pg_stat_statements). A PL/pgSQL function keeps the plans of
-- its statements for the session, so the body is planned on the first calls of a
-- connection and reused after: on one Postgres 15 connection the key-index trigger cost
-- 36 to 42 µs of Postgres CPU per ledger row with the SQL function, 20 to 24 with this
-- one. Postgres 18 (the embedded server) keeps SQL functions' plans itself, and there the
-- two cost the same (docs/performance.md, "Issue 19, sixth round").
--
-- The body, and so the result for every record, is unchanged: the top-level keys of the
-- record's "patch", sorted, '{}' when it has none. IMMUTABLE, STRICT and PARALLEL SAFE
-- stay true. On Citus the replacement reaches every worker, where the shards' triggers
-- run (tests/citus/test_upgrade.py).

CREATE OR REPLACE FUNCTION ztate.patch_keys(document bytea) RETURNS text[]
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN (SELECT coalesce(pg_catalog.array_agg(k ORDER BY k), '{}'::text[])
              FROM pg_catalog.jsonb_object_keys(
                       pg_catalog.convert_from(document, 'UTF8')::jsonb -> 'patch') AS k);
END;
$$;
