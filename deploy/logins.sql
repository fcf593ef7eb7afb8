-- The services' database logins: members of their service's roles (created NOLOGIN by
-- the migrations), owning nothing (deploy/README.md, "Database logins"). Run by psql as
-- the owner after `ztate db migrate`, with the names and passwords as variables:
--   psql "$OWNER_DSN" -v ON_ERROR_STOP=1 \
--        -v transition_login=ztate_svc -v transition_password="$(cat ...)" \
--        -v approval_login=ztate_approval_svc -v approval_password="$(cat ...)" \
--        -f deploy/logins.sql
-- Run again, it creates nothing new and sets the passwords again. Compose's `logins`
-- service runs it; tests/integration/test_scale_out.py runs it and serves with the logins.

SELECT pg_catalog.format('CREATE ROLE %I LOGIN IN ROLE ztate_transition, ztate_reader',
                         :'transition_login')
 WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = :'transition_login')
\gexec
SELECT pg_catalog.format('ALTER ROLE %I PASSWORD %L', :'transition_login',
                         :'transition_password')
\gexec
-- with ZTATE_MIGRATE_ON_START=false the service only reads which migrations ran
GRANT SELECT ON public.ztate_schema_migrations TO :"transition_login";

SELECT pg_catalog.format('CREATE ROLE %I LOGIN IN ROLE ztate_approver', :'approval_login')
 WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = :'approval_login')
\gexec
SELECT pg_catalog.format('ALTER ROLE %I PASSWORD %L', :'approval_login',
                         :'approval_password')
\gexec
GRANT SELECT ON public.ztate_approval_schema_migrations TO :"approval_login";
