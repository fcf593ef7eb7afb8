-- A decision names the certificate it was made with, so that a revocation made before
-- the review closes takes the decision back (docs/approvals.md, "Revoked reviewers").
--
-- An approval counted toward a review's k approvals whoever revoked its reviewer
-- afterwards: a reviewer key stolen and used to approve, then revoked (by serial or by
-- identity), still made a receipt when one honest reviewer approved, signed after the
-- revocation. The service now counts, when a review would close, only the approvals
-- whose identity and certificate the revocation list, as it is then, does not name.
-- Identity revocations need only the reviewer column; a certificate's revocation needs
-- its serial, kept here (lower-case hexadecimal, as the revocation list writes it).
-- Decisions recorded before this migration have none: only their identity is checked.
-- A nullable column without a default: no rewrite of the table, an instant under the
-- ALTER's lock.

ALTER TABLE ztate_approval.decisions ADD COLUMN IF NOT EXISTS cert_serial text;
