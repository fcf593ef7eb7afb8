-- Group commit plans its statement to probe by index, whatever the statistics (issue 19).
--
-- The batch statement of group commit (services/store/group_commit.py) was sent as it
-- stands, a prepared statement of each pooled connection. After five runs Postgres keeps
-- a generic plan for it, made with the statistics of that moment: on a fresh database
-- (or before autovacuum has analysed the tables) the tables hold a few rows, and the
-- cheapest plan hashes them whole (sequential scans of the heads, the ledger, the parked
-- proposals and the watched threads). That plan stayed in use as the ledger grew, so
-- every batch read every head and every ledger row: in the end-to-end benchmark (fresh
-- database, 32 writers, 10 s) 200 to 350 rows read per commit and about 40 % of
-- Postgres's CPU per commit (docs/performance.md, "Issue 19, fifth round").
--
-- A batch holds at most 64 rows, each touching one head, one idempotency key, one
-- thread's work and wake mark: probing each by its index is always the right plan. The
-- statement now runs inside this function, whose planner settings rule out sequential
-- scans, hash joins and merge joins (nested loops over the batch's rows, index probes
-- into every table), so the plan is the same whatever the statistics when it was made.
-- (They hold for everything that runs during the call, the ledger's triggers and its
-- foreign-key check included: each probes by key.)
-- The statement itself is unchanged: each row its own compare-and-swap, idempotency
-- outcome, wakes and wake mark, exactly as before. One call, one round trip, as before.
-- Group commit is not used on Citus (each commit leaves alone there), so the function
-- is not distributed.

CREATE OR REPLACE FUNCTION ztate.commit_batch(
    p_thread_id text[], p_expected bigint[], p_version bigint[], p_digest text[],
    p_state bytea[], p_parent text[], p_node_id text[], p_key_id text[], p_signature text[],
    p_committed_at timestamptz[], p_record bytea[], p_idempotency_key text[],
    p_request_digest text[], p_wake_n bigint[], p_wake_node text[])
    RETURNS TABLE (n bigint, committed boolean, key_taken boolean, watched boolean)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH input AS (
        SELECT *
          FROM unnest(p_thread_id, p_expected, p_version, p_digest, p_state, p_parent,
                      p_node_id, p_key_id, p_signature, p_committed_at, p_record,
                      p_idempotency_key, p_request_digest)
               WITH ORDINALITY AS i(thread_id, expected, version, digest, state, parent, node_id,
                                    key_id, signature, committed_at, record, idempotency_key,
                                    request_digest, n)
    ), locked AS (
        -- every head of the batch, locked in one order whatever the batch: no deadlock
        SELECT t.thread_id FROM ztate.threads t
         WHERE t.thread_id IN (SELECT thread_id FROM input)
         ORDER BY t.thread_id
           FOR UPDATE
    ), taken AS (
        -- rows whose idempotency key names a committed request already: KEY_TAKEN
        SELECT i.n FROM input i
         WHERE i.idempotency_key IS NOT NULL AND EXISTS (
               SELECT 1 FROM ztate.transitions x
                WHERE x.thread_id = i.thread_id AND x.node_id = i.node_id
                  AND x.idempotency_key = i.idempotency_key)
    ), head AS (
        UPDATE ztate.threads t
           SET version = i.version, head_digest = i.digest, state = i.state,
               updated_at = i.committed_at
          FROM input i JOIN locked l ON l.thread_id = i.thread_id
         WHERE t.thread_id = i.thread_id AND t.version = i.expected AND t.head_digest = i.parent
           AND i.n NOT IN (SELECT n FROM taken)
           -- an idempotency key names one request, whether committed or parked
           AND NOT EXISTS (SELECT 1 FROM ztate.pending_transitions p
                            WHERE p.thread_id = i.thread_id AND p.node_id = i.node_id
                              AND p.idempotency_key = i.idempotency_key)
     RETURNING t.thread_id
    ), appended AS (
        INSERT INTO ztate.transitions (thread_id, version, digest, parent_digest, node_id, key_id,
                                       signature, record, state, idempotency_key, request_digest,
                                       committed_at)
        SELECT i.thread_id, i.version, i.digest, i.parent, i.node_id, i.key_id, i.signature,
               i.record, i.state, i.idempotency_key, i.request_digest, i.committed_at
          FROM input i JOIN head h ON h.thread_id = i.thread_id
        RETURNING thread_id
    ), woke AS (
        -- the nodes each committed row wakes (p_wake_n: the row's ordinal, p_wake_node:
        -- the node), and its thread's wake mark, as ztate.commit_transition records
        -- them (migration 0018)
        INSERT INTO ztate.node_work AS w (thread_id, node, wake_version)
        SELECT i.thread_id, k.node, i.version
          FROM unnest(p_wake_n, p_wake_node) AS k(n, node)
          JOIN input i ON i.n = k.n
          JOIN head h ON h.thread_id = i.thread_id
        ON CONFLICT (thread_id, node) DO UPDATE
           SET wake_version = greatest(w.wake_version, excluded.wake_version)
        RETURNING 1
    ), marked AS (
        UPDATE ztate.wake_marks m SET evaluated_version = greatest(m.evaluated_version, i.version)
          FROM input i JOIN head h ON h.thread_id = i.thread_id
         WHERE m.thread_id = i.thread_id AND m.evaluated_version >= i.expected
        RETURNING 1
    )
    SELECT i.n,
           EXISTS (SELECT 1 FROM appended a WHERE a.thread_id = i.thread_id) AS committed,
           i.n IN (SELECT n FROM taken) AS key_taken,
           EXISTS (SELECT 1 FROM ztate.watched_threads w WHERE w.thread_id = i.thread_id)
               AS watched
      FROM input i
     ORDER BY i.n;
END;
$$;

REVOKE ALL ON FUNCTION ztate.commit_batch(text[], bigint[], bigint[], text[], bytea[], text[],
    text[], text[], text[], timestamptz[], bytea[], text[], text[], bigint[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.commit_batch(text[], bigint[], bigint[], text[], bytea[], text[],
    text[], text[], text[], timestamptz[], bytea[], text[], text[], bigint[], text[])
    TO :service_role;
