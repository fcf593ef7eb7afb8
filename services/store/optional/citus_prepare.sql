-- Optional, NOT part of the numbered migrations: the schema changes the Citus
-- layout needs, in plain SQL, so they can run (and are tested) on any Postgres.
-- Applied by `ztate db citus` before citus_distribute.sql, in a transaction of its
-- own (the distribution's statements follow one by one), as the owner of the ztate
-- schema. Idempotent.
--
-- Citus requires every PRIMARY KEY and UNIQUE constraint of a distributed table
-- to include the distribution column, and foreign keys between distributed
-- tables to be on it. Of the schema of migrations 0001-0007:
--
--   threads              PK (thread_id)                           compatible
--   transitions          PK (thread_id, version)                  compatible
--                        UNIQUE (thread_id, parent_digest)        compatible (the fork guard)
--                        UNIQUE (digest)                          NOT compatible: replaced
--                          by UNIQUE (thread_id, digest). Nothing is lost: a digest is
--                          SHA-256 over a record that contains its thread_id, so one
--                          digest in two threads is a SHA-256 collision.
--                        transitions_idempotency (thread_id, node_id, idempotency_key)
--                                                                 compatible
--                        FK thread_id -> threads                  compatible (co-located)
--   pending_transitions  PK (digest)                              NOT compatible: becomes
--                          PK (thread_id, digest), same argument as above
--                        UNIQUE (thread_id, node_id, idempotency_key)  compatible
--                        FK thread_id -> threads                  compatible (co-located)
--   checkpoints          PK (thread_id, version), FK -> threads   compatible
--   transition_keys      PK (key, committed_at, digest)           NOT compatible, and no
--                          thread_id: gains thread_id (filled from transitions), PK
--                          (key, committed_at, digest, thread_id); its insert trigger
--                          writes NEW.thread_id
--   receipts             becomes a reference table (no thread_id; a nonce must stay
--                          unique across every thread): its FK to pending_transitions
--                          (reference -> distributed is not allowed) is dropped. The
--                          transition service checks the receipt's digest against the
--                          parked transition before it inserts, in the same statement.
--   rejections           stays on the coordinator (a Citus local table): thread_id may
--                          be NULL (refusals before a thread is known) and its key is a
--                          global identity. It is written only on refusals, never on
--                          the commit path.
--
-- Triggers: the append-only triggers (refuse_history_rewrite, pending_status_only)
-- look at their own row only, so they run on each shard unchanged. Two read or
-- write another table: transitions_prune_only reads ztate.threads for the same
-- thread_id, index_transition_keys inserts into ztate.transition_keys for the
-- same thread_id; with every table co-located on thread_id both stay on one
-- shard group, and Citus runs them with citus.enable_unsafe_triggers (set by
-- citus_distribute.sql).

-- On a database laid out already (a second `ztate db citus`), the statements below
-- read and alter distributed tables and replace a function Citus propagates: over
-- one connection per node, or Citus refuses the function command after a parallel
-- read in the same transaction. (A placeholder setting on plain Postgres.)
SET LOCAL citus.multi_shard_modify_mode TO 'sequential';

ALTER TABLE ztate.transitions DROP CONSTRAINT IF EXISTS transitions_digest_key;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint
                    WHERE conname = 'transitions_thread_digest_key'
                      AND conrelid = 'ztate.transitions'::regclass) THEN
        ALTER TABLE ztate.transitions
            ADD CONSTRAINT transitions_thread_digest_key UNIQUE (thread_id, digest);
    END IF;
END;
$$;

ALTER TABLE ztate.receipts DROP CONSTRAINT IF EXISTS receipts_transition_digest_fkey;

DO $$
BEGIN
    IF (SELECT pg_catalog.array_length(conkey, 1) FROM pg_catalog.pg_constraint
         WHERE conname = 'pending_transitions_pkey'
           AND conrelid = 'ztate.pending_transitions'::regclass) = 1 THEN
        ALTER TABLE ztate.pending_transitions DROP CONSTRAINT pending_transitions_pkey;
        ALTER TABLE ztate.pending_transitions
            ADD CONSTRAINT pending_transitions_pkey PRIMARY KEY (thread_id, digest);
    END IF;
END;
$$;

ALTER TABLE ztate.transition_keys ADD COLUMN IF NOT EXISTS thread_id text;
-- The back-fill runs only while some row lacks its thread, that is before the table is
-- distributed (thread_id is then its distribution column, never NULL). Citus refuses
-- even to plan an UPDATE of a distribution column, so outside this guard a second
-- `ztate db citus` (after citus_add_node, or after an upgrade) failed.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM ztate.transition_keys WHERE thread_id IS NULL) THEN
        -- derived rows only: the append-only trigger is lifted for the back-fill alone
        ALTER TABLE ztate.transition_keys DISABLE TRIGGER transition_keys_append_only;
        UPDATE ztate.transition_keys k SET thread_id = t.thread_id
          FROM ztate.transitions t
         WHERE k.thread_id IS NULL AND t.digest = k.digest;
        -- a key row whose record is gone (only a superuser's repair can do that) has no
        -- thread
        DELETE FROM ztate.transition_keys WHERE thread_id IS NULL;
        ALTER TABLE ztate.transition_keys ENABLE TRIGGER transition_keys_append_only;
    END IF;
END;
$$;
ALTER TABLE ztate.transition_keys ALTER COLUMN thread_id SET NOT NULL;
DO $$
BEGIN
    IF (SELECT pg_catalog.array_length(conkey, 1) FROM pg_catalog.pg_constraint
         WHERE conname = 'transition_keys_pkey'
           AND conrelid = 'ztate.transition_keys'::regclass) = 3 THEN
        ALTER TABLE ztate.transition_keys DROP CONSTRAINT transition_keys_pkey;
        ALTER TABLE ztate.transition_keys
            ADD CONSTRAINT transition_keys_pkey PRIMARY KEY (key, committed_at, digest, thread_id);
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION ztate.index_transition_keys() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ztate.transition_keys (key, committed_at, digest, node_id, thread_id)
    SELECT k, NEW.committed_at, NEW.digest, NEW.node_id, NEW.thread_id
      FROM pg_catalog.unnest(ztate.patch_keys(NEW.record)) AS k;
    RETURN NULL;
END;
$$;

-- The key index's trigger is that row trigger here: each commit is one row on Citus, and
-- each shard's trigger writes its row's thread_id. Migration 0027 makes it a statement
-- trigger on a ledger not laid out yet (one with no thread_id in its key index); it is
-- put back here, before the ledger is distributed, and 0027 leaves it on a ledger
-- prepared here (even if its distribution then failed).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                    WHERE tgrelid = 'ztate.transitions'::regclass
                      AND tgname = 'transitions_index_keys'
                      AND tgfoid = 'ztate.index_transition_keys()'::regprocedure) THEN
        DROP TRIGGER IF EXISTS transitions_index_keys ON ztate.transitions;
        CREATE TRIGGER transitions_index_keys
            AFTER INSERT ON ztate.transitions
            FOR EACH ROW EXECUTE FUNCTION ztate.index_transition_keys();
    END IF;
END;
$$;
