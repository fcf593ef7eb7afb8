-- The sweep of watched threads (migration 0009) keyed each row by the text of its
-- backend start's epoch, through extract(epoch FROM timestamptz): a STABLE function
-- (it depends on the session's time zone), which Citus refuses to evaluate on
-- column values in a distributed DELETE. The same key, computed from the interval
-- since the epoch (timestamptz - timestamptz and extract from an interval are
-- IMMUTABLE), means the same thing on plain Postgres and runs on every shard.

CREATE OR REPLACE FUNCTION ztate.sweep_watched_threads() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    live text[];
    swept bigint;
BEGIN
    -- '<pid>/<seconds from the epoch to backend_start>' of every backend, or
    -- '<pid>/*' when its start is hidden; a plain array keeps the DELETE one
    -- statement per shard.
    SELECT coalesce(array_agg(a.pid::text || '/' ||
                              coalesce(extract(epoch FROM a.backend_start
                                                    - '1970-01-01 00:00:00+00'::timestamptz)::text,
                                       '*')),
                    '{}')
      INTO live
      FROM pg_catalog.pg_stat_activity a;
    DELETE FROM ztate.watched_threads w
     WHERE NOT (w.backend_pid::text || '/' ||
                extract(epoch FROM w.backend_start
                                   - '1970-01-01 00:00:00+00'::timestamptz)::text = ANY (live)
                OR w.backend_pid::text || '/*' = ANY (live));
    GET DIAGNOSTICS swept = ROW_COUNT;
    RETURN swept;
END;
$$;
