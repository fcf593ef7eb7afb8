-- What a reviewer is shown is derived by the approval service from the proposal and
-- its base record and state (approval_service/review.py), never from a summary the
-- transition service writes. The transition service now keeps only the changed keys
-- its policy marks sensitive, which the approval service shows as keyed digests.
ALTER TABLE ztate.pending_transitions
    ADD COLUMN IF NOT EXISTS sensitive_keys text[] NOT NULL DEFAULT '{}';
-- the summary of rows parked before this migration stays as evidence; new rows hold '{}'
ALTER TABLE ztate.pending_transitions ALTER COLUMN redacted_diff SET DEFAULT '\x7b7d'::bytea;
