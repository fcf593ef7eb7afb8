-- Key each replica's watched threads by the identity of its LISTEN connection
-- (backend pid and backend start), so that rows of a replica that died without
-- unregistering can be found and removed: their backend no longer exists in
-- pg_stat_activity. Before, a crashed replica left NOTIFY cost on its threads
-- forever.
--
-- The service role cannot see backend_start of other sessions (pg_stat_activity
-- hides it from roles without pg_read_all_stats), nor of its own when it got its
-- role by SET ROLE. Two narrow SECURITY DEFINER functions, owned by the role that
-- runs migrations, give it exactly what it needs: its own backend identity, and
-- the sweep. If even their owner cannot see backend_start, the sweep falls back to
-- the pid alone.

-- Rows of 0008 name no backend; running streams fall back to their periodic
-- re-read until their replica registers again.
DELETE FROM ztate.watched_threads;
ALTER TABLE ztate.watched_threads DROP CONSTRAINT IF EXISTS watched_threads_pkey;
ALTER TABLE ztate.watched_threads DROP COLUMN IF EXISTS replica;
ALTER TABLE ztate.watched_threads ADD COLUMN IF NOT EXISTS backend_pid integer NOT NULL;
ALTER TABLE ztate.watched_threads ADD COLUMN IF NOT EXISTS backend_start timestamptz NOT NULL;
ALTER TABLE ztate.watched_threads ADD PRIMARY KEY (thread_id, backend_pid, backend_start);

CREATE OR REPLACE FUNCTION ztate.session_backend(OUT pid integer, OUT backend_start timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT a.pid, coalesce(a.backend_start, pg_catalog.pg_postmaster_start_time())
      FROM pg_catalog.pg_stat_activity a
     WHERE a.pid = pg_catalog.pg_backend_pid()
$$;

CREATE OR REPLACE FUNCTION ztate.sweep_watched_threads() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    live text[];
    swept bigint;
BEGIN
    -- '<pid>/<epoch of backend_start>' of every backend, or '<pid>/*' when its
    -- start is hidden; a plain array keeps the DELETE one statement per shard.
    SELECT coalesce(array_agg(a.pid::text || '/' ||
                              coalesce(extract(epoch FROM a.backend_start)::text, '*')),
                    '{}')
      INTO live
      FROM pg_catalog.pg_stat_activity a;
    DELETE FROM ztate.watched_threads w
     WHERE NOT (w.backend_pid::text || '/' || extract(epoch FROM w.backend_start)::text = ANY (live)
                OR w.backend_pid::text || '/*' = ANY (live));
    GET DIAGNOSTICS swept = ROW_COUNT;
    RETURN swept;
END;
$$;

REVOKE ALL ON FUNCTION ztate.session_backend() FROM PUBLIC;
REVOKE ALL ON FUNCTION ztate.sweep_watched_threads() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.session_backend() TO :service_role;
GRANT EXECUTE ON FUNCTION ztate.sweep_watched_threads() TO :service_role;

-- A trigger function runs with the committing role's search_path: pin it.
ALTER FUNCTION ztate.announce_commit() SET search_path = pg_catalog, pg_temp;
