-- Retention: a record's state body may be pruned, never the record. The state
-- is a convenience copy (the verifier replays it from the patches and checks it
-- against the signed state_digest), so dropping old bodies keeps every digest,
-- signature and link of the chain. :pruner_role may do exactly that and nothing
-- else; every other change to a ledger row stays refused, superusers included.

ALTER TABLE ztate.transitions ALTER COLUMN state DROP NOT NULL;

-- One UPDATE is allowed: state from a body to NULL, every other column unchanged,
-- and never on the thread's head (whose state the service builds on).
CREATE OR REPLACE FUNCTION ztate.transitions_prune_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE'
       AND OLD.state IS NOT NULL AND NEW.state IS NULL
       AND (to_jsonb(NEW) - 'state') = (to_jsonb(OLD) - 'state') THEN
        IF OLD.version >= (SELECT h.version FROM ztate.threads h
                            WHERE h.thread_id = OLD.thread_id) THEN
            RAISE EXCEPTION 'ztate: the state of a thread''s head is never pruned'
                USING ERRCODE = 'insufficient_privilege';
        END IF;
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'ztate: % on %.% is refused: the ledger is append-only '
                    '(only pruning a state body to NULL is allowed)',
        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

DROP TRIGGER IF EXISTS transitions_append_only ON ztate.transitions;
CREATE TRIGGER transitions_append_only
    BEFORE UPDATE OR DELETE ON ztate.transitions
    FOR EACH ROW EXECUTE FUNCTION ztate.transitions_prune_only();

-- The pruner reads what it needs to choose rows and may null one column.
GRANT USAGE ON SCHEMA ztate TO :pruner_role;
GRANT SELECT (thread_id, version) ON ztate.threads TO :pruner_role;
GRANT SELECT (thread_id, version, committed_at, state) ON ztate.transitions TO :pruner_role;
GRANT UPDATE (state) ON ztate.transitions TO :pruner_role;
