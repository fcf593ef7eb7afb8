-- Announce new ledger records of watched threads on the ztate_commits channel
-- (payload: the thread id), in the transaction that inserts them, so that
-- WatchThread streams on every replica wake up once they are committed. A trigger
-- covers every path that appends a record: commits, approved commits, reverts.
--
-- NOTIFY serialises committing transactions on a global queue lock, so only
-- threads somebody watches are announced: each replica registers the threads its
-- streams watch in ztate.watched_threads (unlogged: it is rebuilt by the streams
-- themselves), and unregisters them when their last stream ends.

CREATE UNLOGGED TABLE IF NOT EXISTS ztate.watched_threads (
    thread_id text NOT NULL,
    replica   text NOT NULL,
    since     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (thread_id, replica)
);

REVOKE ALL ON ztate.watched_threads FROM PUBLIC;
GRANT SELECT, INSERT, DELETE ON ztate.watched_threads TO :service_role;

CREATE OR REPLACE FUNCTION ztate.announce_commit() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM ztate.watched_threads w WHERE w.thread_id = NEW.thread_id) THEN
        PERFORM pg_notify('ztate_commits', NEW.thread_id);
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS transitions_announce_commit ON ztate.transitions;
CREATE TRIGGER transitions_announce_commit
    AFTER INSERT ON ztate.transitions
    FOR EACH ROW EXECUTE FUNCTION ztate.announce_commit();
