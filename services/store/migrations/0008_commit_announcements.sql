-- Announce every new ledger record on the ztate_commits channel (payload: the
-- thread id), in the transaction that inserts it, so that WatchThread streams on
-- every replica wake up once it is committed. A trigger covers every path that
-- appends a record: commits, approved commits, reverts and genesis.

CREATE OR REPLACE FUNCTION ztate.announce_commit() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('ztate_commits', NEW.thread_id);
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS transitions_announce_commit ON ztate.transitions;
CREATE TRIGGER transitions_announce_commit
    AFTER INSERT ON ztate.transitions
    FOR EACH ROW EXECUTE FUNCTION ztate.announce_commit();
