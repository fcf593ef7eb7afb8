-- A proposal made under a lease commits in one round trip (issue 19).
--
-- A worker driven by SubscribeWork proposes with the epoch of its lease grant. Until
-- now that cost three statements: the fence (does grant `epoch` still hold the lease on
-- (thread, node)?), the commit, and the release (the lease given back, the node done
-- with the versions up to the one it built on). ztate.commit_transition now takes the
-- grant (p_lease_node, p_lease_epoch; both NULL for a proposal under no lease) and does
-- all three in its one transaction:
--
-- - first the fence, exactly the old one (a row of that node on that thread at that
--   epoch with a holder): when the grant no longer holds the lease, nothing is written
--   and the call answers -1, before the compare-and-swap (a lost lease is refused as
--   LEASE_LOST whatever the head);
-- - then the commit as in migration 0018; a head that moved answers NULL, an
--   idempotency key taken raises unique_violation: either way the lease is untouched,
--   as before (the service releases it after a replay, as it did);
-- - then, the version committed, the release, exactly the old one (holder and expiry
--   cleared, handled_version raised to the expected version), after the wakes, as
--   before. The release is a compare-and-swap on the epoch like the old one: if the
--   grant lost the lease between the fence and here (its own ReleaseLease, or another
--   grant after it lapsed), the commit stands and the lease is left to its new owner,
--   as the old separate release did.
--
-- The answer is a small integer: NULL head moved, -1 lease lost (nothing written);
-- otherwise committed, with bit 1 set when a replica watches the thread, bit 2 when
-- the commit released the lease and bit 4 when, released, more work waits for the node.
--
-- The new arguments change the function's signature: the old one is dropped. `ztate db
-- citus` distributes the new one by its thread id like the old
-- (services/store/optional/citus_distribute.sql): run it again after this migration.
-- node_work is co-located with threads, so on Citus the call stays on one worker.

DROP FUNCTION IF EXISTS ztate.commit_transition(text, bigint, bigint, text, bytea, text, text,
    text, text, timestamptz, bytea, text, text, text[]);

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
              AND l.epoch = p_lease_epoch AND l.holder IS NOT NULL) THEN
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
