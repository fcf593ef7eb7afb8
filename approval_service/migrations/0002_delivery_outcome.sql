-- What the transition service did with a decision, as it answered its delivery:
-- "committed", "rejected", "stale", "refused: <REASON>" (approved, but no longer
-- allowed by the policy in force when it came to commit), or another definitive
-- refusal's reason. Reviewers see it on the review (docs/approvals.md).
ALTER TABLE ztate_approval.receipts ADD COLUMN IF NOT EXISTS outcome text;
GRANT UPDATE (delivered_at, outcome) ON ztate_approval.receipts TO :approval_role;
