-- Every hex digest's CHECK without a counted regular expression (issue 19).
--
-- A digest, a parent digest, a signature and a policy digest are 64 lower-case hex
-- characters, and each column said so as `x ~ '^[0-9a-f]{64}$'`. Postgres's regular
-- expressions run a lazily built DFA that is thrown away after each match, and a counted
-- repetition has a state per position: every check built 64 states anew. A commit runs
-- four such checks (the head's digest, and the new record's digest, parent digest and
-- signature): a `perf` profile of a Postgres backend running the group commit (the
-- bench's 1 KB transition, batches of three) put the regular-expression engine (`miss`,
-- `getvacant`, `shortest`) at 9 % of its CPU, about 28 µs a committed row, the largest
-- single item of the profile.
--
-- The rule is unchanged and now reads `length(x) = 64 AND x !~ '[^0-9a-f]'`: exactly 64
-- characters, none outside 0-9 and a-f (the same bracket, so the same characters; a NULL
-- passes either form, and every one of these columns is NOT NULL). Its DFA has two states.
-- tests/integration/test_hex_checks.py holds the two forms equal over hostile values
-- and checks each column's refusal.
--
-- Each constraint is dropped and added again under its own name, each an ALTER TABLE
-- of its own run by the one DO statement below: Citus passes an ADD CONSTRAINT on to a
-- distributed table's shards with the text of the command that made it, which must be
-- one command with no other subcommand (each shard then checks its own rows).
--
-- Each ALTER takes an ACCESS EXCLUSIVE lock on its table (its reads and writes wait),
-- held until the migrations being applied commit (they run in one transaction). So
-- that this lasts milliseconds whatever the ledger's size, a table that holds rows gets
-- its new check NOT VALID: the check it replaces, the same rule, held for every row
-- there, and every row written from now on is checked as before. Validating it would
-- read the whole table under that lock (1.2 s for 300,000 ledger rows of 3 KB cached in
-- memory, with the ledger's three checks). An operator may validate it later, online
-- (SHARE UPDATE EXCLUSIVE: reads and commits go on), with `ALTER TABLE ztate.transitions
-- VALIDATE CONSTRAINT transitions_digest_check` and so on (docs/operations.md). An
-- empty table (a new database), or one whose old check is missing, gets a validated
-- check.

DO $$
DECLARE
    hex record;
    replaced_holds boolean;  -- rows there, all checked by the constraint replaced
BEGIN
    FOR hex IN
        SELECT * FROM (VALUES
            ('ztate.threads', 'threads_head_digest_check', 'head_digest'),
            ('ztate.transitions', 'transitions_digest_check', 'digest'),
            ('ztate.transitions', 'transitions_parent_digest_check', 'parent_digest'),
            ('ztate.transitions', 'transitions_signature_check', 'signature'),
            ('ztate.pending_transitions', 'pending_transitions_digest_check', 'digest'),
            ('ztate.pending_transitions', 'pending_transitions_parent_digest_check',
             'parent_digest'),
            ('ztate.checkpoints', 'checkpoints_head_digest_check', 'head_digest'),
            ('ztate.policies', 'policies_policy_digest_check', 'policy_digest'),
            ('ztate.receipts', 'receipts_receipt_digest_check', 'receipt_digest')
        ) AS checks (relation, name, col)
    LOOP
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s) AND EXISTS (SELECT 1 FROM '
                       'pg_catalog.pg_constraint WHERE conrelid = %L::regclass AND '
                       'conname = %L AND convalidated)', hex.relation, hex.relation, hex.name)
           INTO replaced_holds;
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT IF EXISTS %I', hex.relation, hex.name);
        EXECUTE format('ALTER TABLE %s ADD CONSTRAINT %I CHECK (length(%I) = 64 AND %I !~ %L)%s',
                       hex.relation, hex.name, hex.col, hex.col, '[^0-9a-f]',
                       CASE WHEN replaced_holds THEN ' NOT VALID' ELSE '' END);
    END LOOP;
END;
$$;
