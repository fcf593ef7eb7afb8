-- A proposal parked under a lease is fenced by the park itself.
--
-- A risky proposal made under a lease grant (a SubscribeWork worker's) was fenced by a
-- statement of its own (does grant `epoch` still hold the lease on (thread, node)?) and
-- parked by the next one: a grant that lost the lease in between (its lease lapsed and
-- another grant took it, or it was released) still parked its proposal, which then
-- waited for a human decision although a stale holder made it. A commit has carried its
-- fence since migration 0019; ztate.park_transition now takes the grant too
-- (p_lease_node, p_lease_epoch; both NULL for a proposal under no lease):
--
-- - first the fence: the row of that node on that thread at that epoch with a holder,
--   locked FOR SHARE, so that no release or new grant changes it before the parked row
--   commits with it; when the grant no longer holds the lease, nothing is written and
--   the call answers NULL, whatever else is true (a lost lease is refused as
--   LEASE_LOST, before a taken key or a proposal parked already);
-- - then the park as in migration 0016: true when parked now, false when the digest or
--   the idempotency key is parked already, or the key names a committed request.
--
-- The lease is not released here: the service releases it after the answer, as before.
--
-- The new arguments make a new function (an overload): the 13-argument one of migration
-- 0016 stays, so that replicas of the release before, which fence with a statement of
-- their own and then park with it, keep parking during a rolling upgrade instead of
-- failing every risky proposal on a function that no longer exists. Its body becomes a
-- call of the new one under no lease (one implementation of the park). This release
-- never calls it; a later migration drops it. `ztate db citus` distributes the
-- new one by its thread id like the old (services/store/optional/citus_distribute.sql):
-- run it again after this migration. node_work is co-located with threads, so on Citus
-- the call stays on one worker.

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

CREATE OR REPLACE FUNCTION ztate.park_transition(
    p_thread_id text, p_digest text, p_base_version bigint, p_parent text, p_node_id text,
    p_proposal bytea, p_state bytea, p_risk_rules text[], p_idempotency_key text,
    p_request_digest text, p_parked_at timestamptz, p_sensitive_keys text[],
    p_required_approvals integer) RETURNS boolean
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    SELECT ztate.park_transition(p_thread_id, p_digest, p_base_version, p_parent, p_node_id,
                                 p_proposal, p_state, p_risk_rules, p_idempotency_key,
                                 p_request_digest, p_parked_at, p_sensitive_keys,
                                 p_required_approvals, NULL::text, NULL::bigint)
$$;
