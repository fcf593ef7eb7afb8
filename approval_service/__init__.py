"""The approval service: collects human decisions bound to one transition digest.

Not yet implemented; see issue 4. It will run as its own process with its own
database role and Ed25519 signing key.
"""
