-- An approved transition is checked again against the policy in force when it
-- commits; one that no longer passes ends 'refused' (with a rejection row naming the
-- reason), so that every approved transition reaches a definite outcome.
ALTER TABLE ztate.pending_transitions DROP CONSTRAINT IF EXISTS pending_transitions_status_check;
ALTER TABLE ztate.pending_transitions ADD CONSTRAINT pending_transitions_status_check
    CHECK (status IN ('pending', 'committed', 'rejected', 'expired', 'stale', 'refused'));
