-- Commits of watched threads are announced by the session that commits them, on
-- the ztate_commits channel, after the commit statement (services/store/
-- transitions.py, announce_commit), no longer by a trigger on ztate.transitions
-- (migration 0008).
--
-- On Citus the trigger runs on the worker that holds the thread's shard, and a
-- NOTIFY on a worker never reaches the LISTEN connections, which are on the
-- coordinator: watchers saw commits only through their periodic re-read. Every
-- commit statement goes through a coordinator session, so announcing from that
-- session reaches every replica, on Citus as on plain Postgres. The commit
-- statement itself says whether the thread is watched (ztate.watched_threads,
-- read on the thread's own shard), so unwatched threads still cost nothing, and
-- the announcement no longer holds the commit's row locks while it waits for
-- NOTIFY's global queue lock. A replica that dies between its commit and the
-- announcement leaves the watchers to their re-read, as a lost LISTEN connection
-- does.

DROP TRIGGER IF EXISTS transitions_announce_commit ON ztate.transitions;
DROP FUNCTION IF EXISTS ztate.announce_commit();
