-- Optional, NOT part of the numbered migrations: distribute the transition
-- service's tables on a Citus coordinator, after citus_prepare.sql. Run by
-- `ztate db citus` as a superuser (citus.enable_unsafe_triggers is a superuser
-- setting) in a database where `CREATE EXTENSION citus` was run and the workers
-- were added. Idempotent: a table already in Citus' metadata is skipped.
--
-- Every thread-keyed table is hash-distributed by thread_id and co-located with
-- ztate.threads, so everything one thread touches lives in one shard group and
-- the commit (UPDATE threads ... WHERE thread_id = $1 ..., INSERT INTO
-- transitions ...) is a single-shard router statement.

-- The triggers of transitions read or write only rows of the same thread_id
-- (co-located); Citus runs triggers on distributed tables only with this set.
DO $$
BEGIN
    EXECUTE pg_catalog.format('ALTER DATABASE %I SET citus.enable_unsafe_triggers = on',
                              pg_catalog.current_database());
END;
$$;
SET citus.enable_unsafe_triggers = on;

DO $$
DECLARE
    distributed text[] := ARRAY['ztate.threads', 'ztate.transitions',
                                'ztate.pending_transitions', 'ztate.checkpoints',
                                'ztate.transition_keys', 'ztate.watched_threads'];
    name text;
BEGIN
    FOREACH name IN ARRAY distributed LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                        WHERE logicalrelid = name::regclass) THEN
            IF name = 'ztate.threads' THEN
                PERFORM create_distributed_table(name::regclass, 'thread_id');
            ELSE
                PERFORM create_distributed_table(name::regclass, 'thread_id',
                                                 colocate_with => 'ztate.threads');
            END IF;
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                    WHERE logicalrelid = 'ztate.receipts'::regclass) THEN
        PERFORM create_reference_table('ztate.receipts');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                    WHERE logicalrelid = 'ztate.rejections'::regclass) THEN
        PERFORM citus_add_local_table_to_metadata('ztate.rejections');
    END IF;
END;
$$;
