-- Ledger queries run as :reader_role, which can read the ledger and nothing else.

GRANT USAGE ON SCHEMA ztate TO :reader_role;
GRANT SELECT ON ztate.threads, ztate.transitions, ztate.rejections,
                ztate.pending_transitions TO :reader_role;
