-- A review's digest CHECK without a counted regular expression, as the transition
-- service's migration 0026 writes every hex digest's: `length(x) = 64 AND x !~
-- '[^0-9a-f]'` (exactly 64 characters, none outside 0-9 and a-f) instead of
-- `x ~ '^[0-9a-f]{64}$'`, whose DFA Postgres builds anew at every check with a state
-- per position. The same rule, so the same digests pass. Where reviews exist and the
-- check replaced held for them, the new check is added NOT VALID (no read of the table
-- under the ALTER's lock; the transition service's 0026 says why); validate it online
-- later with `ALTER TABLE ztate_approval.reviews VALIDATE CONSTRAINT
-- reviews_digest_check`.

DO $$
DECLARE
    replaced_holds boolean := EXISTS (SELECT 1 FROM ztate_approval.reviews)
        AND EXISTS (SELECT 1 FROM pg_catalog.pg_constraint
                     WHERE conrelid = 'ztate_approval.reviews'::regclass
                       AND conname = 'reviews_digest_check' AND convalidated);
BEGIN
    ALTER TABLE ztate_approval.reviews DROP CONSTRAINT IF EXISTS reviews_digest_check;
    IF replaced_holds THEN
        ALTER TABLE ztate_approval.reviews ADD CONSTRAINT reviews_digest_check
            CHECK (length(digest) = 64 AND digest !~ '[^0-9a-f]') NOT VALID;
    ELSE
        ALTER TABLE ztate_approval.reviews ADD CONSTRAINT reviews_digest_check
            CHECK (length(digest) = 64 AND digest !~ '[^0-9a-f]');
    END IF;
END;
$$;
