-- Every commit records whom it wakes, in the commit itself (issue 19).
--
-- Until now the transition service decided a version's wakes after the commit, in a
-- background task: three round trips (the thread's progress, the versions after its
-- wake mark, the wakes and the mark written in a transaction of their own, with a WAL
-- flush of its own) for every commit, whether or not it woke anyone. It cost more
-- Postgres CPU than the commit. The service now decides the wakes of every version
-- before it commits it (a creation, a proposal, a revert, an approved decision: it
-- holds the patch, the new state and the author, all a wake declaration needs), and
-- the commit writes them with the version, atomically: ztate.node_work rows for the
-- nodes it wakes (none, mostly) and the thread's wake mark advanced to the new
-- version when every version before it was decided (the mark at the expected
-- version or beyond). A version is therefore never committed undecided. Only a
-- thread committed before this migration can have a mark behind its head: commits
-- then leave the mark where it is, so that it never passes a version nobody decided,
-- and the sweep catches the thread up (deciding twice changes nothing: a wake
-- version only grows).
--
-- The new argument changes the functions' signatures: the old ones are dropped.
-- `ztate db citus` distributes the new commit function by its thread id like the old
-- (services/store/optional/citus_distribute.sql): run it again after this migration.
-- node_work and wake_marks are co-located with threads, so on Citus the commit stays
-- local to one worker.

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
    UPDATE ztate.wake_marks m SET evaluated_version = greatest(m.evaluated_version, p_version)
     WHERE m.thread_id = p_thread_id AND m.evaluated_version >= p_expected;
    RETURN EXISTS (SELECT 1 FROM ztate.watched_threads w WHERE w.thread_id = p_thread_id);
END;
$$;

REVOKE ALL ON FUNCTION ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text, text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text, text[]) TO :service_role;

-- An approved decision's commit (ztate.commit_approved, migration 0016) with the nodes
-- its version wakes, recorded as ztate.commit_transition records them (and announced on
-- ztate_work: the function runs on the coordinator, where every replica listens). An
-- approval whose thread moved on since it was parked now also closes the parked row as
-- stale and announces it, in the same call: outcome 'head moved' with status 'stale'
-- (before, the caller sent a second transaction for it). 'not pending' still writes
-- nothing.
DROP FUNCTION IF EXISTS ztate.commit_approved(text, bigint, bigint, text, bytea, text, text, text,
    text, timestamptz, bytea, text, text, text, bytea, text, text, text, text);

CREATE OR REPLACE FUNCTION ztate.commit_approved(
    p_thread_id text, p_expected bigint, p_version bigint, p_digest text, p_state bytea,
    p_parent text, p_node_id text, p_key_id text, p_signature text,
    p_committed_at timestamptz, p_record bytea, p_idempotency_key text,
    p_request_digest text, p_pending text, p_receipt bytea, p_receipt_signature text,
    p_receipt_key_id text, p_receipt_digest text, p_nonce text, p_woken text[],
    OUT outcome text, OUT status text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    SELECT pe.status INTO status FROM ztate.pending_transitions pe
     WHERE pe.thread_id = p_thread_id AND pe.digest = p_pending FOR UPDATE;
    IF status IS DISTINCT FROM 'pending' THEN
        outcome := 'not pending';
        RETURN;
    END IF;
    UPDATE ztate.threads t
       SET version = p_version, head_digest = p_digest, state = p_state,
           updated_at = p_committed_at
     WHERE t.thread_id = p_thread_id AND t.version = p_expected AND t.head_digest = p_parent;
    IF NOT FOUND THEN
        UPDATE ztate.pending_transitions pe
           SET status = 'stale', decided_at = p_committed_at
         WHERE pe.thread_id = p_thread_id AND pe.digest = p_pending;
        PERFORM pg_notify('ztate_outcomes', p_pending);
        outcome := 'head moved';
        status := 'stale';
        RETURN;
    END IF;
    UPDATE ztate.pending_transitions pe
       SET status = 'committed', decided_at = p_committed_at
     WHERE pe.thread_id = p_thread_id AND pe.digest = p_pending;
    INSERT INTO ztate.transitions (thread_id, version, digest, parent_digest, node_id, key_id,
                                   signature, record, state, idempotency_key, request_digest,
                                   committed_at, receipt, receipt_signature, receipt_key_id)
    VALUES (p_thread_id, p_version, p_digest, p_parent, p_node_id, p_key_id, p_signature,
            p_record, p_state, p_idempotency_key, p_request_digest, p_committed_at, p_receipt,
            p_receipt_signature, p_receipt_key_id);
    INSERT INTO ztate.receipts (receipt_digest, transition_digest, decision, nonce, receipt,
                                signature, key_id, applied_at)
    VALUES (p_receipt_digest, p_pending, 'approve', p_nonce, p_receipt, p_receipt_signature,
            p_receipt_key_id, p_committed_at);
    IF cardinality(p_woken) > 0 THEN
        INSERT INTO ztate.node_work AS w (thread_id, node, wake_version)
        SELECT p_thread_id, n, p_version FROM unnest(p_woken) AS n
        ON CONFLICT (thread_id, node) DO UPDATE
           SET wake_version = greatest(w.wake_version, excluded.wake_version);
    END IF;
    UPDATE ztate.wake_marks m SET evaluated_version = greatest(m.evaluated_version, p_version)
     WHERE m.thread_id = p_thread_id AND m.evaluated_version >= p_expected;
    PERFORM pg_notify('ztate_outcomes', p_pending);
    IF EXISTS (SELECT 1 FROM ztate.watched_threads w WHERE w.thread_id = p_thread_id) THEN
        PERFORM pg_notify('ztate_commits', p_thread_id);
    END IF;
    IF cardinality(p_woken) > 0 THEN
        PERFORM pg_notify('ztate_work', n) FROM unnest(p_woken) AS n;
    END IF;
    outcome := 'committed';
    status := 'committed';
END;
$$;

REVOKE ALL ON FUNCTION ztate.commit_approved(text, bigint, bigint, text, bytea, text, text, text,
    text, timestamptz, bytea, text, text, text, bytea, text, text, text, text, text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.commit_approved(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text, text, bytea, text, text, text, text, text[])
    TO :service_role;
