"""``ztate.services.verify.parallel`` runs its database workers' event loops through
asyncio's public API only: a private name (``asyncio.events._set_running_loop``) may
change or go in any Python release, and the verifier is what auditors run for years."""

from __future__ import annotations

import ast
from pathlib import Path

from ztate.services.verify import parallel


def test_the_parallel_verifier_uses_no_private_asyncio_api() -> None:
    tree = ast.parse(Path(parallel.__file__).read_text())
    private = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and ast.unparse(node.value).split(".")[0] == "asyncio"
    ]
    assert private == []
