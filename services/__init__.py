"""The core shared by the ztate services, in sub-packages that show the architecture
(docs/architecture.md): runtime, policy, store, verify and cli. The core imports no server."""
