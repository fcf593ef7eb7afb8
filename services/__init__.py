"""The core shared by the ztate services: canonical encoding, the chain, policy,
identity, storage, configuration and the mapping of domain errors to gRPC."""
