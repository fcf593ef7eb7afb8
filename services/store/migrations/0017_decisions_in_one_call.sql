-- Every ApplyDecision outcome in one call after its lookup (issue 19: at most 3 round
-- trips; an approving decision already was one call of ztate.commit_approved, 0016).
--
-- A rejecting receipt, an approval the policy in force no longer allows, and an approval
-- whose thread moved on each cost a transaction of four or five statements (BEGIN, the
-- parked row's status, the receipt or rejection row, the announcement, COMMIT). Each is
-- now one function, like ztate.commit_approved and for the same reasons not distributed:
-- the receipt is a reference table, the rejection a coordinator table, and the
-- announcement must reach the coordinator's LISTEN sessions; on Citus the statement on
-- ztate.pending_transitions is a router query to the worker holding the thread.
--
-- SECURITY INVOKER: each runs with the caller's (the service role's) privileges.

-- A rejection: the parked row rejected, the receipt recorded (its nonce is unique
-- forever: a used one raises unique_violation and the call rolls back), the status
-- change announced on ztate_outcomes. False when the row was no longer pending
-- (nothing written).
CREATE OR REPLACE FUNCTION ztate.close_rejected(
    p_thread_id text, p_pending text, p_at timestamptz, p_receipt_digest text, p_nonce text,
    p_receipt bytea, p_receipt_signature text, p_receipt_key_id text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE ztate.pending_transitions pe SET status = 'rejected', decided_at = p_at
     WHERE pe.thread_id = p_thread_id AND pe.digest = p_pending AND pe.status = 'pending';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO ztate.receipts (receipt_digest, transition_digest, decision, nonce, receipt,
                                signature, key_id, applied_at)
    VALUES (p_receipt_digest, p_pending, 'reject', p_nonce, p_receipt, p_receipt_signature,
            p_receipt_key_id, p_at);
    PERFORM pg_notify('ztate_outcomes', p_pending);
    RETURN true;
END;
$$;

REVOKE ALL ON FUNCTION ztate.close_rejected(text, text, timestamptz, text, text, bytea, text,
    text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.close_rejected(text, text, timestamptz, text, text, bytea, text,
    text) TO :service_role;

-- An approved transition the policy in force refuses: the parked row refused, the
-- rejection row that says why (a woken waiter always finds it), the announcement. False
-- when the row was no longer pending (nothing written).
CREATE OR REPLACE FUNCTION ztate.close_refused(
    p_thread_id text, p_pending text, p_at timestamptz, r_method text, r_node_id text,
    r_base_version bigint, r_reason text, r_keys text[], r_message text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE ztate.pending_transitions pe SET status = 'refused', decided_at = p_at
     WHERE pe.thread_id = p_thread_id AND pe.digest = p_pending AND pe.status = 'pending';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO ztate.rejections (method, node_id, thread_id, base_version, reason, keys,
                                  patch_digest, patch_bytes, message)
    VALUES (r_method, r_node_id, p_thread_id, r_base_version, r_reason, r_keys, NULL, NULL,
            r_message);
    PERFORM pg_notify('ztate_outcomes', p_pending);
    RETURN true;
END;
$$;

REVOKE ALL ON FUNCTION ztate.close_refused(text, text, timestamptz, text, text, bigint, text,
    text[], text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.close_refused(text, text, timestamptz, text, text, bigint, text,
    text[], text) TO :service_role;

-- ztate.commit_approved (0016) as before, except that an approval whose thread moved on
-- since it was parked now also closes the parked row as stale and announces it, in the
-- same call: outcome 'head moved' with status 'stale' (before, the caller sent a second
-- transaction for it). 'not pending' still writes nothing.
CREATE OR REPLACE FUNCTION ztate.commit_approved(
    p_thread_id text, p_expected bigint, p_version bigint, p_digest text, p_state bytea,
    p_parent text, p_node_id text, p_key_id text, p_signature text,
    p_committed_at timestamptz, p_record bytea, p_idempotency_key text,
    p_request_digest text, p_pending text, p_receipt bytea, p_receipt_signature text,
    p_receipt_key_id text, p_receipt_digest text, p_nonce text,
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
    PERFORM pg_notify('ztate_outcomes', p_pending);
    IF EXISTS (SELECT 1 FROM ztate.watched_threads w WHERE w.thread_id = p_thread_id) THEN
        PERFORM pg_notify('ztate_commits', p_thread_id);
    END IF;
    outcome := 'committed';
    status := 'committed';
END;
$$;
