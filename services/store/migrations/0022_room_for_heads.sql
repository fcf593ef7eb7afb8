-- The heads are stored with room for their next versions (issue 19).
--
-- Every commit rewrites its thread's row in ztate.threads (version, digest, state). An
-- update can stay on its page, a heap-only tuple with no new index entry, only if the
-- page has room for the new version; the dead versions are pruned to make room only when
-- no transaction still sees them and no other backend holds the page, which under a
-- steady stream of commits is seldom. Filled to the brim by inserts, the pages had no
-- room: in the end-to-end benchmark (32 writers, 10 s) only 55 % of head updates stayed
-- in place, each other one added an entry to the heads' index and a new page, and the
-- table of 32 heads grew to 6 to 7 MB. With the pages half filled by inserts, 99.7 % stay
-- in place and the table stays under 250 KB; Postgres spent 20 to 70 µs less CPU per
-- commit and ztate committed 3 to 13 % more a second (three alternating pairs).
--
-- The cost: the heads take about twice the pages (one row a thread; the ledger, one row
-- a version, is unchanged). Pages written before this migration fill as they were;
-- pg_repack rewrites them with the room while commits go on (`VACUUM FULL ztate.threads`
-- does too, but holds an ACCESS EXCLUSIVE lock, and every commit waits, while it runs).
-- The ALTER itself takes a SHARE UPDATE EXCLUSIVE lock for an instant, as 0021's.

ALTER TABLE ztate.threads SET (fillfactor = 50);
