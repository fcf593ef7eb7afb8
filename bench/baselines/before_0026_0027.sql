-- The commit path's definitions before migrations 0026 and 0027 (issue 19, seventh
-- round), put back in a migrated database by `python -m bench.commit_cpu --before`:
-- the counted hex checks on the heads and the ledger, and the row trigger of the key
-- index with the patch_keys of migration 0023.

ALTER TABLE ztate.threads DROP CONSTRAINT threads_head_digest_check,
    ADD CONSTRAINT threads_head_digest_check CHECK (head_digest ~ '^[0-9a-f]{64}$');
ALTER TABLE ztate.transitions DROP CONSTRAINT transitions_digest_check,
    ADD CONSTRAINT transitions_digest_check CHECK (digest ~ '^[0-9a-f]{64}$'),
    DROP CONSTRAINT transitions_parent_digest_check,
    ADD CONSTRAINT transitions_parent_digest_check CHECK (parent_digest ~ '^[0-9a-f]{64}$'),
    DROP CONSTRAINT transitions_signature_check,
    ADD CONSTRAINT transitions_signature_check CHECK (signature ~ '^[0-9a-f]{64}$');

CREATE OR REPLACE FUNCTION ztate.patch_keys(document bytea) RETURNS text[]
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN (SELECT coalesce(pg_catalog.array_agg(k ORDER BY k), '{}'::text[])
              FROM pg_catalog.jsonb_object_keys(
                       pg_catalog.convert_from(document, 'UTF8')::jsonb -> 'patch') AS k);
END;
$$;

CREATE OR REPLACE FUNCTION ztate.index_transition_keys() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ztate.transition_keys (key, committed_at, digest, node_id)
    SELECT k, NEW.committed_at, NEW.digest, NEW.node_id
      FROM pg_catalog.unnest(ztate.patch_keys(NEW.record)) AS k;
    RETURN NULL;
END;
$$;

DROP TRIGGER transitions_index_keys ON ztate.transitions;
CREATE TRIGGER transitions_index_keys
    AFTER INSERT ON ztate.transitions
    FOR EACH ROW EXECUTE FUNCTION ztate.index_transition_keys();
