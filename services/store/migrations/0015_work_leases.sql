-- Work of nodes on threads, and the leases that let several processes of one node
-- share it (SubscribeWork, docs/work.md).
--
-- A version of a thread wakes the nodes whose wake declaration it meets (the
-- policy's nodes.<name>.wake, decided by the transition service after the commit).
-- ztate.node_work keeps, per thread and node, the newest version that woke the node
-- and the newest version the node finished with: the node has work while the first
-- is ahead of the second. The same row is the lease: one holder at a time, taken by
-- compare-and-swap when it is free or lapsed, each grant under a new epoch (the
-- fencing token: a proposal under an older epoch is refused), renewed while the
-- handler runs, released when it proposes or stops.
--
-- ztate.wake_marks says up to which version each thread's wakes were decided, so
-- that a replica that died between a commit and its wakes leaves nothing undecided:
-- every replica's sweep picks up threads whose head is ahead of their mark.
--
-- Both are keyed by thread_id first, so that on Citus they are distributed by
-- thread_id and co-located with ztate.threads (services/store/optional/
-- citus_distribute.sql).

CREATE TABLE IF NOT EXISTS ztate.node_work (
    thread_id       text NOT NULL,
    node            text NOT NULL,
    wake_version    bigint NOT NULL,
    handled_version bigint NOT NULL DEFAULT -1,
    epoch           bigint NOT NULL DEFAULT 0,
    holder          text,
    expires_at      timestamptz,
    PRIMARY KEY (thread_id, node),
    CONSTRAINT node_work_held CHECK ((holder IS NULL) = (expires_at IS NULL))
);

-- what the dispatchers look for: work waiting for a node
CREATE INDEX IF NOT EXISTS node_work_waiting
    ON ztate.node_work (node, thread_id) WHERE wake_version > handled_version;

CREATE TABLE IF NOT EXISTS ztate.wake_marks (
    thread_id         text PRIMARY KEY,
    evaluated_version bigint NOT NULL
);

REVOKE ALL ON ztate.node_work, ztate.wake_marks FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE ON ztate.node_work, ztate.wake_marks TO :service_role;
-- operators see each thread's work and leases (ztate threads show)
GRANT SELECT ON ztate.node_work, ztate.wake_marks TO :reader_role;
