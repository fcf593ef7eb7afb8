-- The approval service's own schema. Its role can touch nothing of the
-- transition service, and the transition service's role nothing of this.

CREATE SCHEMA IF NOT EXISTS ztate_approval;
REVOKE ALL ON SCHEMA ztate_approval FROM PUBLIC;

CREATE TABLE IF NOT EXISTS ztate_approval.reviews (
    digest             text PRIMARY KEY CHECK (digest ~ '^[0-9a-f]{64}$'),
    thread_id          text NOT NULL,
    base_version       bigint NOT NULL CHECK (base_version >= 0),
    node_id            text NOT NULL,
    risk_rules         text[] NOT NULL,
    required_approvals integer NOT NULL CHECK (required_approvals >= 1),
    proposal           bytea NOT NULL,
    redacted_diff      bytea NOT NULL,
    status             text NOT NULL DEFAULT 'open'
                       CHECK (status IN ('open', 'approved', 'rejected', 'expired')),
    opened_at          timestamptz NOT NULL DEFAULT now(),
    expires_at         timestamptz NOT NULL,
    closed_at          timestamptz
);

CREATE INDEX IF NOT EXISTS reviews_open ON ztate_approval.reviews (opened_at)
    WHERE status = 'open';

CREATE TABLE IF NOT EXISTS ztate_approval.decisions (
    digest      text NOT NULL REFERENCES ztate_approval.reviews (digest),
    reviewer    text NOT NULL,
    decision    text NOT NULL CHECK (decision IN ('approve', 'reject')),
    decided_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (digest, reviewer)
);

CREATE TABLE IF NOT EXISTS ztate_approval.receipts (
    digest       text PRIMARY KEY REFERENCES ztate_approval.reviews (digest),
    receipt      bytea NOT NULL,
    signature    text NOT NULL,
    key_id       text NOT NULL,
    nonce        text NOT NULL UNIQUE,
    signed_at    timestamptz NOT NULL DEFAULT now(),
    -- the outbox: set once the transition service has taken the decision
    delivered_at timestamptz
);

GRANT USAGE ON SCHEMA ztate_approval TO :approval_role;
GRANT SELECT, INSERT ON ztate_approval.reviews, ztate_approval.decisions,
                        ztate_approval.receipts TO :approval_role;
GRANT UPDATE (status, closed_at) ON ztate_approval.reviews TO :approval_role;
GRANT UPDATE (delivered_at) ON ztate_approval.receipts TO :approval_role;
