-- Every ApplyDecision outcome in one call after its lookup (issue 19: at most 3 round
-- trips; an approving decision already was one call of ztate.commit_approved, 0016, and
-- 0018 makes it close a parked row whose thread moved on as stale itself).
--
-- A rejecting receipt and an approval the policy in force no longer allows each cost a
-- transaction of five statements (BEGIN, the parked row's status, the receipt or
-- rejection row, the announcement, COMMIT). Each is now one function, like
-- ztate.commit_approved and for the same reasons not distributed:
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
