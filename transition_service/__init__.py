"""The transition service: authenticates nodes, checks their proposals against the
policy, and commits accepted transitions to the signed, chained ledger."""
