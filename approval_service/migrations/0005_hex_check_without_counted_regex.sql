-- A review's digest CHECK without a counted regular expression, as the transition
-- service's migration 0026 writes every hex digest's: `length(x) = 64 AND x !~
-- '[^0-9a-f]'` (exactly 64 characters, none outside 0-9 and a-f) instead of
-- `x ~ '^[0-9a-f]{64}$'`, whose DFA Postgres builds anew at every check with a state
-- per position. The same rule, so the same digests pass. The ALTER rewrites nothing; it
-- reads the reviews once to validate the constraint, blocking new reviews meanwhile.

ALTER TABLE ztate_approval.reviews DROP CONSTRAINT IF EXISTS reviews_digest_check;
ALTER TABLE ztate_approval.reviews ADD CONSTRAINT reviews_digest_check
    CHECK (length(digest) = 64 AND digest !~ '[^0-9a-f]');
