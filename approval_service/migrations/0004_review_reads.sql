-- The reviews' reads and updates, each led by an index to the rows it returns.
--
-- Closing an overdue review (ztate.approval_service.store.EXPIRE_OPEN: status 'open' and
-- expires_at before now) read every open review, no index having expires_at:
-- reviews_open_expiry holds the open reviews in deadline order, so an expiry pass reads
-- those overdue. A page of the review list (ListReviews: one status, perhaps one thread,
-- keyset pagination on (opened_at, digest)) read every review and sorted those of the
-- status, whatever the statistics: the status is a parameter, which the partial
-- reviews_open cannot serve in a generic plan, and no index had thread_id.
-- reviews_by_status and reviews_by_thread hold the reviews in the list's order under
-- their status (and thread): a page reads the reviews it returns.
--
-- Building them reads the reviews once and blocks new reviews and their closing (a
-- decision that closes one, the expiry pass) while it runs; on a very large table
-- create them first with CREATE INDEX CONCURRENTLY under these names
-- (docs/operations.md), and this migration finds them there. A concurrent build that
-- failed leaves an invalid index of that name, which the planner never uses: this
-- migration then fails, naming it (drop it, build it again, migrate again). The checks
-- and the indexes are one statement: Citus passes on the index of a table it manages
-- with the text of the statement that made it, which must then be one command.

DO $$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['reviews_open_expiry', 'reviews_by_status',
                                'reviews_by_thread'] LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_index
                    WHERE indexrelid = pg_catalog.to_regclass('ztate_approval.' || name)
                      AND NOT (indisvalid AND indisready)) THEN
            RAISE EXCEPTION 'the index ztate_approval.% exists but is not valid (a CREATE '
                'INDEX CONCURRENTLY that failed?): drop it, then migrate again', name;
        END IF;
    END LOOP;
    CREATE INDEX IF NOT EXISTS reviews_open_expiry
        ON ztate_approval.reviews (expires_at)
        WHERE status = 'open';
    CREATE INDEX IF NOT EXISTS reviews_by_status
        ON ztate_approval.reviews (status, opened_at, digest);
    CREATE INDEX IF NOT EXISTS reviews_by_thread
        ON ztate_approval.reviews (thread_id, status, opened_at, digest);
END;
$$;
