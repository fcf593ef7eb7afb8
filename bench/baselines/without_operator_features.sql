-- What the ledger's operator features cost a commit (docs/performance.md, issue 19,
-- twelfth round): the database as migrated, less what serves operators' queries and
-- not the commit itself. The three time-ordered indexes of the ledger
-- (ListTransitions by time, node, thread), the changed-key index (KeyHistory and
-- ListTransitions by changed key: its statement trigger and table) and the foreign
-- key from the ledger to the heads (the commit's compare-and-swap on the head row
-- already proves the thread exists). A measurement's baseline only: no deployment runs
-- this (`python -m bench.commit_cpu --before bench/baselines/without_operator_features.sql`).
DROP INDEX ztate.transitions_by_time;
DROP INDEX ztate.transitions_by_node;
DROP INDEX ztate.transitions_by_thread_time;
DROP TRIGGER transitions_index_keys ON ztate.transitions;
ALTER TABLE ztate.transitions DROP CONSTRAINT transitions_thread_id_fkey;
