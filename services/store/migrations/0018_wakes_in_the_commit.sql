-- A commit records whom it wakes, in the commit itself (issue 19).
--
-- Until now the transition service decided a version's wakes after the commit, in a
-- background task: three round trips (the thread's progress, the versions after its
-- wake mark, the wakes and the mark written in a transaction of their own, with a WAL
-- flush of its own) for every commit, whether or not it woke anyone. It cost more
-- Postgres CPU than the commit. The service now decides the wakes of a proposal or a
-- revert before it commits (it holds the patch, the new state and the author: the
-- policy's wake declarations need nothing else), and the commit writes them with the
-- version, atomically: ztate.node_work rows for the nodes it wakes (none, mostly) and
-- the thread's wake mark advanced from the expected version to the new one. A mark
-- that is elsewhere (not yet written, or behind after a decision made elsewhere) is
-- left alone: the background decision or the sweep, which re-decide idempotently
-- (greatest), catch it up. Thread creations and approved decisions keep the
-- background decision.
--
-- The new argument changes the function's signature: the old one is dropped.
-- `ztate db citus` distributes the new one by its thread id like the old
-- (services/store/optional/citus_distribute.sql); node_work and wake_marks are
-- co-located with threads, so on Citus the call stays local to one worker.

DROP FUNCTION IF EXISTS ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text);

CREATE OR REPLACE FUNCTION ztate.commit_transition(
    p_thread_id text, p_expected bigint, p_version bigint, p_digest text, p_state bytea,
    p_parent text, p_node_id text, p_key_id text, p_signature text,
    p_committed_at timestamptz, p_record bytea, p_idempotency_key text,
    p_request_digest text, p_woken text[]) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE ztate.threads t
       SET version = p_version, head_digest = p_digest, state = p_state,
           updated_at = p_committed_at
     WHERE t.thread_id = p_thread_id AND t.version = p_expected AND t.head_digest = p_parent
       -- an idempotency key names one request, whether committed or parked
       AND NOT EXISTS (SELECT 1 FROM ztate.pending_transitions p
                        WHERE p.thread_id = p_thread_id AND p.node_id = p_node_id
                          AND p.idempotency_key = p_idempotency_key);
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO ztate.transitions (thread_id, version, digest, parent_digest, node_id, key_id,
                                   signature, record, state, idempotency_key, request_digest,
                                   committed_at)
    VALUES (p_thread_id, p_version, p_digest, p_parent, p_node_id, p_key_id, p_signature,
            p_record, p_state, p_idempotency_key, p_request_digest, p_committed_at);
    IF cardinality(p_woken) > 0 THEN
        INSERT INTO ztate.node_work AS w (thread_id, node, wake_version)
        SELECT p_thread_id, n, p_version FROM unnest(p_woken) AS n
        ON CONFLICT (thread_id, node) DO UPDATE
           SET wake_version = greatest(w.wake_version, excluded.wake_version);
    END IF;
    UPDATE ztate.wake_marks m SET evaluated_version = p_version
     WHERE m.thread_id = p_thread_id AND m.evaluated_version = p_expected;
    RETURN EXISTS (SELECT 1 FROM ztate.watched_threads w WHERE w.thread_id = p_thread_id);
END;
$$;

REVOKE ALL ON FUNCTION ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text, text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text, text[]) TO :service_role;
