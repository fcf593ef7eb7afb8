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

-- The script runs as one transaction, and Citus distributes a function (below) only in
-- a transaction that used one connection per worker: distribute sequentially.
SET citus.multi_shard_modify_mode TO 'sequential';

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
                                'ztate.transition_keys', 'ztate.watched_threads',
                                'ztate.node_work', 'ztate.wake_marks'];
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
    -- the policy versions (migration 0014): read by verifiers, written at start-up
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                    WHERE logicalrelid = 'ztate.policies'::regclass) THEN
        PERFORM citus_add_local_table_to_metadata('ztate.policies');
    END IF;
END;
$$;

-- The calls of a worker's request (migrations 0016, 0018, 0019 and 0024), distributed by
-- their thread id and co-located with ztate.threads: Citus delegates each call, made
-- outside a transaction block, to the worker holding the thread's shard group, where it
-- runs as one local transaction (no intermediate results, no two-phase commit).
DO $$
DECLARE
    call regprocedure;
BEGIN
    FOREACH call IN ARRAY ARRAY[
        'ztate.commit_transition(text, bigint, bigint, text, bytea, text, text, text, text,
                                 timestamptz, bytea, text, text, text[], text,
                                 bigint)'::regprocedure,
        'ztate.park_transition(text, text, bigint, text, text, bytea, bytea, text[], text,
                               text, timestamptz, text[], integer, text,
                               bigint)'::regprocedure] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_dist_object
                        WHERE classid = 'pg_proc'::regclass AND objid = call
                          AND distribution_argument_index IS NOT NULL) THEN
            PERFORM create_distributed_function(call, '$1',
                                                colocate_with => 'ztate.threads');
        END IF;
    END LOOP;
END;
$$;

-- Citus runs a statement's shard queries on the workers as the role that runs the
-- statement: for a service session (a login that did SET ROLE ztate_transition)
-- that is the service role, which the migrations create NOLOGIN. Every role
-- granted anything on schema ztate's tables may therefore log in on the workers
-- (only there: on the coordinator, where clients connect, it stays NOLOGIN; the
-- workers' pg_hba.conf decides how the coordinator authenticates). Citus copies
-- roles as the coordinator defines them onto a worker added later: run `ztate db
-- citus` again after citus_add_node.
DO $$
DECLARE
    grantee text;
    failed text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT r.rolname
          FROM (SELECT c.relacl FROM pg_catalog.pg_class c
                 WHERE c.relnamespace = 'ztate'::regnamespace
                UNION ALL  -- column grants (the pruner may update one column)
                SELECT t.attacl FROM pg_catalog.pg_attribute t
                  JOIN pg_catalog.pg_class c ON c.oid = t.attrelid
                 WHERE c.relnamespace = 'ztate'::regnamespace) g(acl)
          CROSS JOIN LATERAL pg_catalog.aclexplode(g.acl) a
          JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
         WHERE NOT r.rolcanlogin
         ORDER BY r.rolname
    LOOP
        -- not propagated back: the worker's own copy of the role alone changes
        SELECT pg_catalog.string_agg(w.nodename || ':' || w.nodeport || ' ' || w.result, '; ')
          INTO failed
          FROM run_command_on_workers(pg_catalog.format(
                   'SET citus.enable_ddl_propagation TO off; ALTER ROLE %I LOGIN', grantee)) w
         WHERE NOT w.success;
        IF failed IS NOT NULL THEN
            RAISE EXCEPTION 'could not let role % log in on the workers: %', grantee, failed;
        END IF;
    END LOOP;
END;
$$;
