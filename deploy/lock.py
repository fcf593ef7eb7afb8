"""Print ``name==version`` for every runtime dependency of ztate (transitively, no
extras) as installed in the running interpreter: deploy/requirements.lock."""

from __future__ import annotations

import re
from importlib import metadata

from packaging.requirements import Requirement

HEADER = """\
# Exact versions of ztate's runtime dependencies (no dev, no bench extras), the
# images' pip constraints (deploy/docker/*.Dockerfile): the same resolution on
# every build. Generated from the development venv's resolution of
# pyproject.toml's [project.dependencies] for Linux x86_64, CPython 3.11:
#   .venv/bin/python deploy/lock.py > deploy/requirements.lock
# No hashes: no package index is reachable where this was generated, so the
# files' digests could not be taken; with an index, add them with
#   pip-compile --generate-hashes (pip-tools) or `pip hash` of downloaded wheels,
# and build with `pip install --require-hashes`.
"""


# Built from this repository beside ztate (worker_sdk/pyproject.toml), never from an index.
FIRST_PARTY = frozenset({"ztate-worker"})


def runtime_closure(root: str = "ztate") -> dict[str, str]:
    """Installed versions of ``root``'s dependencies whose markers hold here, no extras;
    first-party distributions are followed but not pinned."""
    environment = {"extra": ""}
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in metadata.requires(root) or []]
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name in found:
            continue
        distribution = metadata.distribution(requirement.name)
        found[name] = distribution.version
        todo += [Requirement(r) for r in distribution.requires or []]
    return dict(sorted((n, v) for n, v in found.items() if n not in FIRST_PARTY))


if __name__ == "__main__":
    print(HEADER, end="")
    for name, version in runtime_closure().items():
        print(f"{name}=={version}")
