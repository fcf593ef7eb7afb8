-- A page of rejections (ListRejections), led by an index to the rows it returns.
--
-- Rejections are what hostile nodes fill (one row a refused call, kept for good), and
-- an operator pages them newest first by id, filtered by thread, node or reason. The
-- indexes of migration 0001 held (thread_id, rejected_at) and (node_id, rejected_at):
-- a page of one thread or node read all of its rejections and sorted them by id, and
-- a page of one reason walked every rejection from the newest, however rare the
-- reason. These three hold each filter's rows in the page's order, so a page reads
-- the rows it returns (after those a time window skips); the two they replace served
-- nothing else (refusal_at_commit has its own, migration 0025). A window far back
-- (until), alone or within a busy thread or node, walks from the newest row: the
-- ledger's statement timeout cuts it (ZTATE_LEDGER_QUERY_TIMEOUT_SECONDS,
-- QUERY_TOO_COSTLY).
--
-- Building them reads the rejections once and blocks their inserts while it runs (a
-- refused call waits); on a very large table create them first with CREATE INDEX
-- CONCURRENTLY under these names (docs/operations.md), and this migration finds them
-- there. A concurrent build that failed leaves an invalid index of that name, which
-- the planner never uses: this migration then fails, naming it (drop it, build it
-- again, migrate again). The checks, the indexes and the drops are one statement:
-- Citus passes on the index of a table it manages with the text of the statement that
-- made it, which must then be one command (a second command in the file fails there,
-- "cannot insert multiple commands into a prepared statement").

DO $$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['rejections_by_thread_id', 'rejections_by_node_id',
                                'rejections_by_reason_id'] LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_index
                    WHERE indexrelid = pg_catalog.to_regclass('ztate.' || name)
                      AND NOT (indisvalid AND indisready)) THEN
            RAISE EXCEPTION 'the index ztate.% exists but is not valid (a CREATE '
                'INDEX CONCURRENTLY that failed?): drop it, then migrate again', name;
        END IF;
    END LOOP;
    CREATE INDEX IF NOT EXISTS rejections_by_thread_id ON ztate.rejections (thread_id, id);
    CREATE INDEX IF NOT EXISTS rejections_by_node_id ON ztate.rejections (node_id, id);
    CREATE INDEX IF NOT EXISTS rejections_by_reason_id ON ztate.rejections (reason, id);
    DROP INDEX IF EXISTS ztate.rejections_by_thread;
    DROP INDEX IF EXISTS ztate.rejections_by_node;
END;
$$;
