"""``ztate console``: a local web console for reviewers and operators (docs/console.md).

It listens on 127.0.0.1 only and talks to the services over gRPC with the person's own
certificates, as ``kubectl proxy`` does; the browser never holds a certificate.
"""
