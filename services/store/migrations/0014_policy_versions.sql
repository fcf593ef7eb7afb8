-- Every policy version a ledger record names by digest, retrievable (issue 13).
--
-- A record carries only the digest of the policy it was checked against. When a
-- policy is edited, earlier records name the earlier version: to verify them, the
-- verifier needs that version's exact body. The service writes the body of every
-- policy it loads here, before it serves (ON CONFLICT DO NOTHING: a version is
-- written once). body is the RFC 8785 (canonical JSON) bytes of the policy document
-- as written; policy_digest is the lower-case hex SHA-256 of exactly those bytes,
-- the digest records carry (docs/ledger-format.md, "The policy digest"). Nothing
-- here is trusted by a verifier: a body that does not hash to its key is a
-- finding, never a policy.
--
-- Append-only like the ledger: the service role may SELECT and INSERT, never
-- UPDATE or DELETE, and the triggers refuse both (and TRUNCATE) to every role.

CREATE TABLE IF NOT EXISTS ztate.policies (
    policy_digest text PRIMARY KEY CHECK (policy_digest ~ '^[0-9a-f]{64}$'),
    policy_name   text NOT NULL,
    body          bytea NOT NULL,
    loaded_at     timestamptz NOT NULL DEFAULT now()
);

DROP TRIGGER IF EXISTS policies_append_only ON ztate.policies;
CREATE TRIGGER policies_append_only
    BEFORE UPDATE OR DELETE ON ztate.policies
    FOR EACH ROW EXECUTE FUNCTION ztate.refuse_history_rewrite();
DROP TRIGGER IF EXISTS policies_no_truncate ON ztate.policies;
CREATE TRIGGER policies_no_truncate
    BEFORE TRUNCATE ON ztate.policies
    FOR EACH STATEMENT EXECUTE FUNCTION ztate.refuse_history_rewrite();

REVOKE ALL ON ztate.policies FROM PUBLIC;
GRANT SELECT, INSERT ON ztate.policies TO :service_role;
GRANT SELECT ON ztate.policies TO :reader_role;
