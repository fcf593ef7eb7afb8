-- A lapsed lease is lost, whether or not another process has taken it yet.
--
-- docs/work.md has always said so ("RenewLease, ReleaseLease and a fenced proposal give
-- the same answer for ... a lapsed lease"), but the fence of migrations 0019 (the
-- commit) and 0024 (the park) tested only the row's epoch and holder: a grant whose
-- lease had lapsed, and that no process had taken again yet, still committed, parked,
-- renewed (becoming live again) and released. A stream could so hold more live leases
-- than its max_in_flight (a review renewed four lapsed grants of a max_in_flight=1
-- stream) and keep the node's other processes from the work. The fence now also
-- requires `expires_at >= now()` (the database's clock, the one that set the expiry);
-- the release in the commit likewise. The renew, release and fence statements of
-- services/store/work.py test the same.
--
-- Both functions keep their signatures (CREATE OR REPLACE): on Citus, where `ztate db
-- citus` distributed them by their thread id, the replacement reaches the workers.

CREATE OR REPLACE FUNCTION ztate.commit_transition(
    p_thread_id text, p_expected bigint, p_version bigint, p_digest text, p_state bytea,
    p_parent text, p_node_id text, p_key_id text, p_signature text,
    p_committed_at timestamptz, p_record bytea, p_idempotency_key text,
    p_request_digest text, p_woken text[], p_lease_node text, p_lease_epoch bigint)
    RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    answer integer := 0;
    more boolean;
BEGIN
    IF p_lease_epoch IS NOT NULL AND NOT EXISTS (
           SELECT 1 FROM ztate.node_work l
            WHERE l.thread_id = p_thread_id AND l.node = p_lease_node
              AND l.epoch = p_lease_epoch AND l.holder IS NOT NULL
              AND l.expires_at >= now()) THEN
        RETURN -1;
    END IF;
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
    IF p_lease_epoch IS NOT NULL THEN
        UPDATE ztate.node_work l
           SET holder = NULL, expires_at = NULL,
               handled_version = greatest(l.handled_version, p_expected)
         WHERE l.thread_id = p_thread_id AND l.node = p_lease_node
           AND l.epoch = p_lease_epoch AND l.holder IS NOT NULL
           AND l.expires_at >= now()
        RETURNING l.wake_version > l.handled_version INTO more;
        IF FOUND THEN
            answer := answer | 2 | CASE WHEN more THEN 4 ELSE 0 END;
        END IF;
    END IF;
    IF EXISTS (SELECT 1 FROM ztate.watched_threads w WHERE w.thread_id = p_thread_id) THEN
        answer := answer | 1;
    END IF;
    RETURN answer;
END;
$$;

REVOKE ALL ON FUNCTION ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text, text[], text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text, text[], text, bigint) TO :service_role;

CREATE OR REPLACE FUNCTION ztate.park_transition(
    p_thread_id text, p_digest text, p_base_version bigint, p_parent text, p_node_id text,
    p_proposal bytea, p_state bytea, p_risk_rules text[], p_idempotency_key text,
    p_request_digest text, p_parked_at timestamptz, p_sensitive_keys text[],
    p_required_approvals integer, p_lease_node text, p_lease_epoch bigint) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    parked integer;
BEGIN
    IF p_lease_epoch IS NOT NULL THEN
        PERFORM 1 FROM ztate.node_work l
          WHERE l.thread_id = p_thread_id AND l.node = p_lease_node
            AND l.epoch = p_lease_epoch AND l.holder IS NOT NULL
            AND l.expires_at >= now()
            FOR SHARE;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
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

REVOKE ALL ON FUNCTION ztate.park_transition(text, text, bigint, text, text, bytea, bytea,
    text[], text, text, timestamptz, text[], integer, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ztate.park_transition(text, text, bigint, text, text, bytea, bytea,
    text[], text, text, timestamptz, text[], integer, text, bigint) TO :service_role;
