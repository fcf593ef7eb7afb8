-- The work waiting for a node, in the order the dispatcher grants it.
--
-- A dispatch round asks, for each node with free slots, for its waiting rows on threads
-- of its policy, lapsed leases first (services/store/work.py, WAITING). The index of
-- migration 0015 held (node, thread_id): every round read all of a node's waiting rows
-- and sorted them, 70 to 85 ms with 200,000 waiting, and 460 to 900 ms with the look-up
-- of each row's thread that keeps out rows of another policy. This one holds them by
-- (node, expires_at), the grant order: a round reads the rows it grants and those it
-- skips on the way (0.6 ms whether 200 or 200,000 wait, docs/work.md). The one it
-- replaces served no other statement.
--
-- One statement: Citus passes on an index of a table it manages with the text of the
-- statement that made it (migration 0029).

DO $$
BEGIN
    CREATE INDEX IF NOT EXISTS node_work_waiting_in_order
        ON ztate.node_work (node, expires_at) WHERE wake_version > handled_version;
    DROP INDEX IF EXISTS ztate.node_work_waiting;
END;
$$;
