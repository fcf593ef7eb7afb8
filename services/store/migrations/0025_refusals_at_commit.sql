-- The reason an approved transition was refused at commit, found by an index.
--
-- A waiter on a parked proposal that the policy refused when its approval came to
-- commit is told why (PostgresTransitionStore.refusal_at_commit): the newest rejection
-- of method 'ApplyDecision' of that thread, node and base version. No index led there:
-- every plan read all the rejections of the node (rejections_by_node) or of the thread
-- (rejections_by_thread) and sorted them, and the rejections are what hostile nodes
-- fill, one row a refused proposal, kept for good. This index holds only the refusals
-- at commit (rare: an approved proposal the policy in force no longer allows), in the
-- statement's order, so the statement reads one entry of it, walking it backwards; the
-- rejections of proposals do not enter it and cost nothing more.
--
-- Building it reads the rejections once and blocks their inserts while it runs (a
-- refused proposal waits); on a very large table create it first with
-- CREATE INDEX CONCURRENTLY under this name, and this migration finds it there. A
-- concurrent build that failed leaves an invalid index of that name, which the planner
-- never uses: this migration then fails, naming it, rather than be recorded as applied
-- over an index that serves nothing (drop it, build it again, migrate again).
-- On Citus the rejections are the coordinator's table, where this index serves the
-- lookup. The check and the index are one statement: Citus passes on the index of a
-- table it manages with the text of the statement that made it, which must then be one
-- command.

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_index
                WHERE indexrelid = pg_catalog.to_regclass('ztate.rejections_at_commit')
                  AND NOT (indisvalid AND indisready)) THEN
        RAISE EXCEPTION 'the index ztate.rejections_at_commit exists but is not valid (a '
            'CREATE INDEX CONCURRENTLY that failed?): drop it, then migrate again';
    END IF;
    CREATE INDEX IF NOT EXISTS rejections_at_commit
        ON ztate.rejections (thread_id, node_id, base_version, id)
        WHERE method = 'ApplyDecision';
END;
$$;
