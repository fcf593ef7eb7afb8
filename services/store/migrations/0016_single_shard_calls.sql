-- The statements of a worker's call as functions of the thread they touch, so that on
-- Citus each runs on the one worker holding the thread (docs/scale-out.md).
--
-- `ztate db citus` distributes these functions by their first argument, the thread id,
-- co-located with ztate.threads (services/store/optional/citus_distribute.sql): the
-- coordinator then sends the whole call to the worker holding the thread's shard group,
-- where its statements run locally, in one transaction, without intermediate results or
-- a two-phase commit. On plain Postgres the same function is one statement, one round
-- trip: one implementation for both.
--
-- SECURITY INVOKER: each runs with the caller's (the service role's) privileges.

-- The commit: the compare-and-swap on the head and the ledger insert. NULL when the
-- head was not at the expected version and digest, or the idempotency key names a
-- parked request (nothing written); otherwise whether some replica watches the thread
-- (migration 0013: the committer then announces the commit). A key taken by a committed
-- request raises unique_violation: the whole call, head update included, rolls back.
CREATE OR REPLACE FUNCTION ztate.commit_transition(
    p_thread_id text, p_expected bigint, p_version bigint, p_digest text, p_state bytea,
    p_parent text, p_node_id text, p_key_id text, p_signature text,
    p_committed_at timestamptz, p_record bytea, p_idempotency_key text,
    p_request_digest text) RETURNS boolean
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
    RETURN EXISTS (SELECT 1 FROM ztate.watched_threads w WHERE w.thread_id = p_thread_id);
END;
$$;

-- Parking a proposal for approval: true when parked; false when the digest or the
-- idempotency key is parked already, or the key names a committed request.
CREATE OR REPLACE FUNCTION ztate.park_transition(
    p_thread_id text, p_digest text, p_base_version bigint, p_parent text, p_node_id text,
    p_proposal bytea, p_state bytea, p_risk_rules text[], p_idempotency_key text,
    p_request_digest text, p_parked_at timestamptz, p_sensitive_keys text[],
    p_required_approvals integer) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    parked integer;
BEGIN
    IF EXISTS (SELECT 1 FROM ztate.transitions t  -- the key named a committed request
                WHERE t.thread_id = p_thread_id AND t.node_id = p_node_id
                  AND t.idempotency_key = p_idempotency_key) THEN
        RETURN false;
    END IF;
    INSERT INTO ztate.pending_transitions (digest, thread_id, base_version, parent_digest,
                                           node_id, proposal, state, risk_rules,
                                           idempotency_key, request_digest, parked_at,
                                           sensitive_keys, required_approvals)
    VALUES (p_digest, p_thread_id, p_base_version, p_parent, p_node_id, p_proposal, p_state,
            p_risk_rules, p_idempotency_key, p_request_digest, p_parked_at, p_sensitive_keys,
            p_required_approvals)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS parked = ROW_COUNT;
    RETURN parked = 1;
END;
$$;

REVOKE ALL ON FUNCTION ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION ztate.park_transition(text, text, bigint, text, text, bytea, bytea,
    text[], text, text, timestamptz, text[], integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text) TO :service_role;
GRANT EXECUTE ON FUNCTION ztate.park_transition(text, text, bigint, text, text, bytea, bytea,
    text[], text, text, timestamptz, text[], integer) TO :service_role;

-- The head of a thread and what a request's idempotency key names (head_for_request):
-- the head, the committed transition and the parked proposal of the key, each NULL when
-- there is none, read in one query that reaches every table by the thread id (on Citus:
-- one router query to the worker holding the thread); and, when the request is stale
-- (its base version is not the head's, under the same policy, and the key names
-- nothing), its refusal written to ztate.rejections. Not distributed: ztate.rejections
-- is the coordinator's, so the call runs there, and the worker only reads (no two-phase
-- commit, no intermediate results).
CREATE OR REPLACE FUNCTION ztate.head_for_request(
    p_thread_id text, p_node_id text, p_idempotency_key text,
    r_method text, r_node_id text, r_thread_id text, r_base_version bigint, r_reason text,
    r_keys text[], r_patch_digest text, r_patch_bytes integer, r_message text,
    p_policy_name text,
    OUT h ztate.threads, OUT e ztate.transitions, OUT p ztate.pending_transitions,
    OUT refused boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    found record;
BEGIN
    SELECT th, tr, pe INTO found
      FROM (SELECT 1) one
      LEFT JOIN ztate.threads th ON th.thread_id = p_thread_id
      LEFT JOIN ztate.transitions tr
             ON tr.thread_id = p_thread_id AND tr.node_id = p_node_id
            AND tr.idempotency_key = p_idempotency_key
      LEFT JOIN ztate.pending_transitions pe
             ON pe.thread_id = p_thread_id AND pe.node_id = p_node_id
            AND pe.idempotency_key = p_idempotency_key;
    h := found.th;
    e := found.tr;
    p := found.pe;
    refused := (found.th).thread_id IS NOT NULL AND (found.th).version <> r_base_version
               AND (found.th).policy_name = p_policy_name
               AND (found.tr).thread_id IS NULL AND (found.pe).thread_id IS NULL;
    IF refused THEN
        INSERT INTO ztate.rejections (method, node_id, thread_id, base_version, reason, keys,
                                      patch_digest, patch_bytes, message)
        VALUES (r_method, r_node_id, r_thread_id, r_base_version, r_reason, r_keys,
                r_patch_digest, r_patch_bytes, format(r_message, (found.th).version));
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION ztate.head_for_request(text, text, text, text, text, text, bigint, text,
    text[], text, integer, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.head_for_request(text, text, text, text, text, text, bigint,
    text, text[], text, integer, text, text) TO :service_role;

-- Applying an approval (ApplyDecision), in the one transaction of the call: the parked
-- row locked, then the compare-and-swap on the head at the parked base version, the
-- parked row's status and the ledger record, the receipt (whose nonce is unique
-- forever) and the announcements (ztate_outcomes; ztate_commits when the thread is
-- watched). outcome: 'committed'; 'head moved' or 'not pending' (with the parked
-- row's status) wrote nothing. A key or nonce taken meanwhile raises unique_violation:
-- everything rolls back. Not distributed: the receipt is a reference table and the
-- announcements must reach the coordinator's LISTEN sessions; on Citus each statement
-- on the thread's tables is a router query to the worker holding the thread.
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
        outcome := 'head moved';
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

REVOKE ALL ON FUNCTION ztate.commit_approved(text, bigint, bigint, text, bytea, text, text, text,
    text, timestamptz, bytea, text, text, text, bytea, text, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.commit_approved(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text, text, bytea, text, text, text, text)
    TO :service_role;
