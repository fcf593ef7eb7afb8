"""deploy/: the security properties of the images, compose and Kubernetes manifests.

Docker is not available where these tests run, so no image is built: what can be
checked statically is checked here (and schema validation also runs in
`make deploy-check`), so that a regression (a root container, a probe that
starts a process in the pod, a NetworkPolicy that lets a worker reach the database, a
real key in a committed Secret, a setting name that the service ignores) fails
the suite.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import dockerfile
import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ztate.services.cli.main import build_parser
from ztate.services.policy.model import PolicySet
from ztate.services.runtime.config import ApprovalSettings, Settings
from ztate.services.runtime.revocation import RevocationList
from ztate.services.runtime.scrape import LIVE_PATH, LIVE_TIMEOUT_SECONDS, READY_PATH

# distributions built from this repository (deploy/lock.py follows them but pins none)
FIRST_PARTY = frozenset({"ztate-worker"})

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
SECRET_TEMPLATES = K8S / "secrets.yaml"
OTHER_ENV = {"DATABASE_URL", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT"}
Doc = dict[str, Any]


def documents(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def all_docs() -> list[Doc]:
    return [d for p in MANIFESTS for d in documents(p)]


def of_kind(kind: str) -> list[Doc]:
    return [d for d in all_docs() if d["kind"] == kind]


def named(kind: str, name: str) -> Doc:
    (doc,) = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return doc


def workloads() -> Iterator[tuple[str, Doc]]:
    """(name, pod spec) of every Deployment and Job."""
    for doc in all_docs():
        if doc["kind"] in {"Deployment", "Job"}:
            yield doc["metadata"]["name"], doc["spec"]["template"]


def known_env() -> set[str]:
    """Every variable either service reads (pydantic-settings names)."""
    names = {f"ZTATE_{field.upper()}" for field in Settings.model_fields}
    names |= {f"ZTATE_APPROVAL_{field.upper()}" for field in ApprovalSettings.model_fields}
    return names | {"ZTATE_HOME", "ZTATE_TRUST_DOMAIN"} | OTHER_ENV


def subcommand(argv: list[str]) -> str:
    """The function the real ``ztate`` parser dispatches ``argv`` to."""
    assert argv[0] == "ztate"
    name: str = build_parser().parse_args(argv[1:]).func.__name__
    return name


# --- Kubernetes ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_against_the_bundled_kubernetes_schemas(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_every_container_runs_unprivileged_with_a_read_only_root() -> None:
    for name, template in workloads():
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in context["capabilities"], name
            assert context.get("privileged", False) is False, name
            for bound in ("requests", "limits"):
                assert set(container["resources"][bound]) == {"cpu", "memory"}, name


def test_probes_are_http_gets_of_readyz_and_livez_on_the_metrics_port() -> None:
    """The kubelet probes over plain HTTP on the metrics endpoint, which costs the pod no
    process (an exec of `ztate health` cost about 0.45 s of CPU): startup and readiness
    ask /readyz (grpc.health.v1 SERVING), liveness /livez (the event loop runs; it must
    not follow the database: a restart cures no outage), each on the named port
    "metrics" that the service's metrics listen setting opens (docs/operations.md)."""
    for name, template in workloads():
        if name == "ztate-migrate":
            continue
        (container,) = template["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        service = named("Service", name)
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        (metrics,) = [p for p in container["ports"] if p["name"] == "metrics"]
        assert metrics["protocol"] == "TCP"
        listen = (
            "ZTATE_APPROVAL_METRICS_LISTEN"
            if "ZTATE_APPROVAL_LISTEN" in env
            else ("ZTATE_METRICS_LISTEN")
        )
        assert env[listen] == f"0.0.0.0:{metrics['containerPort']}", name
        paths = {
            "startupProbe": READY_PATH,
            "readinessProbe": READY_PATH,
            "livenessProbe": LIVE_PATH,
        }
        assert {k for k in container if k.endswith("Probe")} == set(paths), name
        for kind, path in paths.items():
            probe = container[kind]
            assert set(probe) == {
                "httpGet",
                "periodSeconds",
                "timeoutSeconds",
                "failureThreshold",
            }, f"{name} {kind}"
            assert probe["httpGet"] == {"path": path, "port": "metrics"}, f"{name} {kind}"
            # /livez waits up to LIVE_TIMEOUT_SECONDS for the loop: the kubelet waits longer
            assert probe["timeoutSeconds"] > LIVE_TIMEOUT_SECONDS, f"{name} {kind}"


def test_transition_service_runs_three_replicas_that_survive_a_drain() -> None:
    transition = named("Deployment", "ztate-transition")
    assert transition["spec"]["replicas"] == 3
    assert transition["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    for deployment in of_kind("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        budgets = [
            b
            for b in of_kind("PodDisruptionBudget")
            if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(budgets) == 1, deployment["metadata"]["name"]
    budget = named("PodDisruptionBudget", "ztate-transition")["spec"]
    assert 2 <= budget["minAvailable"] < transition["spec"]["replicas"]


def test_containers_use_only_settings_the_services_read_and_files_they_mount() -> None:
    for name, template in workloads():
        for container in template["spec"]["containers"]:
            mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
            for var in container["env"]:
                assert var["name"] in known_env(), f"{name}: {var['name']} is read by nothing"
                if var["name"] == "DATABASE_URL":  # a DSN carries a password
                    assert "value" not in var
                    assert "secretKeyRef" in var["valueFrom"]
                value = var.get("value", "")
                if value.startswith("/etc/"):
                    assert any(value.startswith(m + "/") or value == m for m in mounts), (
                        f"{name}: {var['name']}={value} is not in a mounted volume"
                    )


def _env_and_mounts(deployment: str) -> tuple[dict[str, str], dict[str, Doc], dict[str, Doc]]:
    """A Deployment's first container: its variables, mounts by path, volumes by name."""
    pod = named("Deployment", deployment)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {v["name"]: v.get("value", "") for v in container["env"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    return env, mounts, volumes


def _volume_of(path: str, mounts: dict[str, Doc], volumes: dict[str, Doc]) -> tuple[Doc, Doc]:
    (mount,) = [m for at, m in mounts.items() if path.startswith(at + "/")]
    return mount, volumes[mount["name"]]


@pytest.mark.parametrize(
    ("deployment", "variable"),
    [
        ("ztate-transition", "ZTATE_REVOCATION_LIST_FILE"),
        ("ztate-approval", "ZTATE_APPROVAL_REVOCATION_LIST_FILE"),
    ],
)
def test_both_services_read_the_revocation_list_that_kustomize_ships(
    deployment: str, variable: str
) -> None:
    """Without it a service reads the default path, which no manifest mounted: a missing
    list revokes nothing, so `ztate ca revoke` cut off no one (found by review). The
    ConfigMap is mounted as a folder (a subPath mount never sees a change) and parses."""
    env, mounts, volumes = _env_and_mounts(deployment)
    mount, volume = _volume_of(env[variable], mounts, volumes)
    assert "subPath" not in mount
    assert volume["configMap"]["name"] == "ztate-revocations"
    shipped = named("ConfigMap", "ztate-revocations")["data"]
    listed = RevocationList.parse(shipped[Path(env[variable]).name].encode())
    assert listed.entries == ()
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "configmap-revocations.yaml" in kustomization["resources"]


def test_the_checkpoint_journal_is_on_a_writable_volume() -> None:
    """The journal's default path is under the image's read-only root: every checkpoint
    round failed, and no checkpoint was ever saved (found by review)."""
    env, mounts, volumes = _env_and_mounts("ztate-transition")
    mount, volume = _volume_of(env["ZTATE_CHECKPOINT_JOURNAL_FILE"], mounts, volumes)
    assert not mount.get("readOnly", False)
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume


def test_committed_secrets_are_templates_that_kustomize_never_applies() -> None:
    templates = documents(SECRET_TEMPLATES)
    secrets = {d["metadata"]["name"]: d for d in templates if d["kind"] == "Secret"}
    assert secrets
    for doc in templates:
        values = {**doc.get("data", {}), **doc.get("stringData", {})}
        assert values, doc["metadata"]["name"]
        for key, value in values.items():
            assert value.startswith("REPLACE-"), f"{doc['metadata']['name']}/{key}"
            assert "BEGIN" not in value
    # no Secret anywhere else in deploy/k8s
    for path in MANIFESTS:
        if path != SECRET_TEMPLATES:
            assert all(d["kind"] != "Secret" for d in documents(path)), path.name
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    assert SECRET_TEMPLATES.name not in kustomization["resources"]
    assert {p.name for p in MANIFESTS} - set(kustomization["resources"]) == {SECRET_TEMPLATES.name}
    # everything the workloads mount or read from a Secret is named in the templates
    for name, template in workloads():
        pod = template["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, name
                assert volume["secret"]["defaultMode"] & 0o007 == 0, name  # not world-readable
        for container in pod["containers"]:
            for var in container["env"]:
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], name


def test_the_policy_config_map_is_a_valid_policy(tmp_path: Path) -> None:
    policy = named("ConfigMap", "ztate-policy")
    for file_name, text in policy["data"].items():
        (tmp_path / file_name).write_text(text, encoding="utf-8")
    assert set(PolicySet.load(tmp_path).policies) == {"pipeline"}


# --- NetworkPolicies, evaluated ------------------------------------------------------------

NAMESPACES = {
    "ztate": {"kubernetes.io/metadata.name": "ztate"},
    "ztate-workers": {"kubernetes.io/metadata.name": "ztate-workers", "ztate.dev/clients": "true"},
    "kube-system": {"kubernetes.io/metadata.name": "kube-system"},
    "observability": {"kubernetes.io/metadata.name": "observability"},
    "elsewhere": {"kubernetes.io/metadata.name": "elsewhere"},
}
for doc in documents(K8S / "namespace.yaml"):
    NAMESPACES[doc["metadata"]["name"]] |= doc["metadata"]["labels"]
Pod = tuple[str, dict[str, str]]  # (namespace, labels)


def pod_labels(deployment: str) -> dict[str, str]:
    labels: dict[str, str] = named("Deployment", deployment)["spec"]["template"]["metadata"][
        "labels"
    ]
    return labels


TRANSITION: Pod = ("ztate", pod_labels("ztate-transition"))
APPROVAL: Pod = ("ztate", pod_labels("ztate-approval"))
MIGRATE: Pod = (
    "ztate",
    named("Job", "ztate-migrate")["spec"]["template"]["metadata"]["labels"],
)
POSTGRES: Pod = ("ztate", {"app.kubernetes.io/name": "postgres"})
COLLECTOR: Pod = ("observability", {"app.kubernetes.io/name": "otel-collector"})
DNS: Pod = ("kube-system", {"k8s-app": "kube-dns"})
WORKER: Pod = ("ztate-workers", {"ztate.dev/role": "worker"})
REVIEWER: Pod = ("ztate-workers", {"ztate.dev/role": "reviewer"})
OPERATOR: Pod = ("ztate-workers", {"ztate.dev/role": "operator"})
PROMETHEUS: Pod = ("observability", {"app.kubernetes.io/name": "prometheus"})


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value, operator = labels.get(expression["key"]), expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if operator == "Exists" and value is None:
            return False
        if operator == "DoesNotExist" and value is not None:
            return False
    return True


def peer_matches(peer: Doc, policy_namespace: str, pod: Pod) -> bool:
    namespace, labels = pod
    if "ipBlock" in peer:
        return False  # pods are reached by selectors in these manifests
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], NAMESPACES[namespace]):
            return False
    elif namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector", {}), labels)


def port_matches(rule: Doc, port: int, protocol: str) -> bool:
    ports = rule.get("ports")
    return not ports or any(
        p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports
    )


def permitted(direction: str, subject: Pod, other: Pod, port: int, protocol: str) -> bool:
    """Whether the policies of ``subject``'s namespace let it send (Egress) to, or
    receive (Ingress) from, ``other`` on ``port``."""
    namespace, labels = subject
    isolating = [
        p
        for p in of_kind("NetworkPolicy")
        if p["metadata"]["namespace"] == namespace
        and direction in p["spec"]["policyTypes"]
        and selects(p["spec"]["podSelector"], labels)
    ]
    if not isolating:
        return True
    key, peers = ("egress", "to") if direction == "Egress" else ("ingress", "from")
    return any(
        port_matches(rule, port, protocol)
        and any(peer_matches(peer, namespace, other) for peer in rule.get(peers, []))
        for policy in isolating
        for rule in policy["spec"].get(key, [])
    )


def reachable(source: Pod, destination: Pod, port: int, protocol: str = "TCP") -> bool:
    return permitted("Egress", source, destination, port, protocol) and permitted(
        "Ingress", destination, source, port, protocol
    )


@pytest.mark.parametrize(
    ("source", "destination", "port", "allowed"),
    [
        (WORKER, TRANSITION, 7443, True),
        (WORKER, DNS, 53, True),
        (WORKER, APPROVAL, 7444, False),
        (WORKER, POSTGRES, 5432, False),
        (WORKER, COLLECTOR, 4317, False),
        (WORKER, TRANSITION, 5432, False),
        (WORKER, ("elsewhere", {}), 443, False),
        (WORKER, WORKER, 7443, False),
        (OPERATOR, TRANSITION, 7443, True),
        (OPERATOR, APPROVAL, 7444, False),
        (REVIEWER, APPROVAL, 7444, True),
        (REVIEWER, TRANSITION, 7443, False),
        (REVIEWER, POSTGRES, 5432, False),
        (TRANSITION, APPROVAL, 7444, True),
        (TRANSITION, POSTGRES, 5432, True),
        (TRANSITION, COLLECTOR, 4317, True),
        (TRANSITION, WORKER, 7443, False),
        (APPROVAL, TRANSITION, 7443, True),
        (APPROVAL, POSTGRES, 5432, True),
        (MIGRATE, POSTGRES, 5432, True),
        (MIGRATE, TRANSITION, 7443, False),
        (("ztate", {"app": "debug"}), POSTGRES, 5432, False),
        (("ztate", {"app": "debug"}), TRANSITION, 7443, False),
        (("ztate-workers", {}), TRANSITION, 7443, False),
        # a pod calling itself a worker outside a clients namespace is not let in
        (("elsewhere", {"ztate.dev/role": "worker"}), TRANSITION, 7443, False),
        # the scrape endpoints: Prometheus only, and only there
        (PROMETHEUS, TRANSITION, 9464, True),
        (PROMETHEUS, APPROVAL, 9464, True),
        (PROMETHEUS, TRANSITION, 7443, False),
        (COLLECTOR, TRANSITION, 9464, False),
        (WORKER, TRANSITION, 9464, False),
        (OPERATOR, TRANSITION, 9464, False),
    ],
)
def test_network_policies_let_each_party_reach_only_its_peers(
    source: Pod, destination: Pod, port: int, allowed: bool
) -> None:
    assert reachable(source, destination, port) is allowed


# --- compose -----------------------------------------------------------------------------


def compose() -> Doc:
    loaded: Doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    return loaded


def test_compose_validates_against_the_compose_spec_schema() -> None:
    text = (
        resources.files("check_jsonschema")
        .joinpath("builtin_schemas/vendor/compose-spec.json")
        .read_text(encoding="utf-8")
    )
    schema = json.loads(text)
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert sorted(e.message for e in validator.iter_errors(compose())) == []


def test_compose_runs_the_stack_with_secrets_as_files_only() -> None:
    spec = compose()
    services = spec["services"]
    assert set(services) == {
        "postgres",
        "migrate",
        "logins",
        "transition",
        "approval",
        "otel-collector",
    }
    assert services["postgres"]["image"].startswith("postgres:15")
    assert services["otel-collector"]["image"].startswith("otel/opentelemetry-collector:")
    for name in ("transition", "approval"):
        assert services[name]["depends_on"]["logins"]["condition"] == (
            "service_completed_successfully"
        )
    assert services["logins"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )
    # the services run as logins that own nothing (deploy/logins.sql, which
    # test_scale_out runs): only the migrations and the logins hold the owner's DSN
    for name, login in (("transition", "transition"), ("approval", "approval")):
        (dsn,) = [
            s
            for s in services[name]["secrets"]
            if isinstance(s, dict) and s["target"] == "database_url"
        ]
        assert dsn["source"] == f"{login}_database_url"
    assert "database_url" in services["logins"]["secrets"]
    assert services["logins"]["configs"] == [
        {"source": "logins", "target": "/etc/ztate/logins.sql"}
    ]
    assert spec["configs"]["logins"]["file"] == "./logins.sql"
    logins = services["logins"]
    assert logins["read_only"] is True
    assert logins["cap_drop"] == ["ALL"]
    assert not logins["user"].startswith("0")
    for name in ("migrate", "transition", "approval"):
        service = services[name]
        assert service["read_only"] is True
        assert service["cap_drop"] == ["ALL"]
        assert "no-new-privileges:true" in service["security_opt"]
        assert not service["user"].startswith("0")
        # the entrypoint only loads DATABASE_URL from its secret file, then runs the command
        assert service["entrypoint"][:2] == ["/bin/sh", "-c"]
        assert "/run/secrets/database_url" in service["entrypoint"][2]
        assert subcommand(service["command"]) in {
            "cmd_db_migrate",
            "cmd_serve",
            "cmd_approval_serve",
        }
        mounted = {
            f"/run/secrets/{s if isinstance(s, str) else s.get('target', s['source'])}"
            for s in service["secrets"]
        } | {c["target"] for c in service.get("configs", [])}
        for variable, value in service.get("environment", {}).items():
            assert variable in known_env(), f"{name}: {variable} is read by nothing"
            assert variable != "DATABASE_URL"
            if str(value).startswith(("/run/", "/etc/")):
                assert value in mounted, f"{name}: {variable}={value} is not mounted"
    # nothing secret is written in the file itself
    postgres_env = services["postgres"]["environment"]
    assert "POSTGRES_PASSWORD" not in postgres_env
    assert postgres_env["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    for secret in spec["secrets"].values():
        assert set(secret) == {"file"}
        assert secret["file"].startswith("./secrets/")
    text = (DEPLOY / "compose.yaml").read_text(encoding="utf-8")
    assert "BEGIN" not in text
    assert not re.search(r"postgres(ql)?://[^@\s]*:[^@\s]+@", text)  # no DSN with a password
    otel = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text(encoding="utf-8"))
    assert otel["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    assert set(otel["service"]["pipelines"]) == {"traces", "metrics", "logs"}


def test_compose_publishes_ports_on_loopback_only() -> None:
    """The services' ports and the collector's unauthenticated OTLP port are reachable
    from this machine only; publishing them wider is a deliberate edit."""
    published = {name: service.get("ports", []) for name, service in compose()["services"].items()}
    assert {name for name, ports in published.items() if ports} == {
        "transition",
        "approval",
        "otel-collector",
    }
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"


def test_services_that_a_migration_job_precedes_do_not_migrate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a Job (or compose service) migrates as the owner, the services only verify
    the schema, so their logins need no CREATE on schema public."""
    services = compose()["services"]
    assert services["transition"]["environment"]["ZTATE_MIGRATE_ON_START"] == "false"
    assert services["approval"]["environment"]["ZTATE_APPROVAL_MIGRATE_ON_START"] == "false"
    for name, variable in (
        ("ztate-transition", "ZTATE_MIGRATE_ON_START"),
        ("ztate-approval", "ZTATE_APPROVAL_MIGRATE_ON_START"),
    ):
        (container,) = named("Deployment", name)["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[variable] == "false", name
    # ... and the services read them by these names
    monkeypatch.setenv("ZTATE_MIGRATE_ON_START", "false")
    monkeypatch.setenv("ZTATE_APPROVAL_MIGRATE_ON_START", "false")
    assert Settings().migrate_on_start is False
    assert ApprovalSettings().migrate_on_start is False


def test_the_migration_job_has_a_deadline() -> None:
    job = named("Job", "ztate-migrate")
    assert 0 < job["spec"]["activeDeadlineSeconds"] <= 3600
    assert job["spec"]["backoffLimit"] <= 3


# --- images ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "entrypoint", "listen"),
    [
        ("transition", ["ztate", "serve"], "ZTATE_LISTEN"),
        ("approval", ["ztate", "approval-serve"], "ZTATE_APPROVAL_LISTEN"),
    ],
)
def test_images_copy_only_sources_run_unprivileged_and_probe_health(
    image: str, entrypoint: list[str], listen: str
) -> None:
    path = DEPLOY / "docker" / f"{image}.Dockerfile"
    commands = dockerfile.parse_file(str(path))
    by = {c.cmd: [x for x in commands if x.cmd == c.cmd] for c in commands}
    assert all(f.value[0] == "python:3.11-slim" for f in by["FROM"])
    for copy in by["COPY"]:
        if any(flag.startswith("--from=") for flag in copy.flags):
            continue
        for source in copy.value[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: no such file"
            assert not source.startswith((".ztate", "deploy/secrets")), source
            assert source != ".", "the whole working tree (and its .ztate/) would be copied"
    (entry,) = by["ENTRYPOINT"]
    assert entry.json
    assert list(entry.value) == entrypoint
    assert subcommand(entrypoint) in {"cmd_serve", "cmd_approval_serve"}
    (health,) = by["HEALTHCHECK"]
    assert health.value[0] == "CMD"
    assert subcommand(list(health.value[1:])) == "cmd_health"
    assert ("--approval" in health.value) == (image == "approval")
    assert by["USER"][-1].value[0].split(":")[0] not in {"0", "root"}
    assert commands[-1].cmd == "ENTRYPOINT"
    env_pairs = [c.value for c in by["ENV"]]
    env = {k: v for pairs in env_pairs for k, v in zip(pairs[::2], pairs[1::2], strict=True)}
    for variable in env:
        assert variable in known_env() | {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"}
        assert not re.search(r"KEY|SECRET|PASSWORD|TOKEN|DATABASE_URL", variable), variable
    assert "ARG" not in by
    (exposed,) = by["EXPOSE"]
    assert env[listen].rsplit(":", 1) == ["0.0.0.0", exposed.value[0]]  # noqa: S104
    ignore = (DEPLOY / "docker" / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[[line.startswith("#") for line in ignore].index(False)] == "*"


def locked() -> dict[str, str]:
    lines = (DEPLOY / "requirements.lock").read_text(encoding="utf-8").splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in pins}


def test_the_lock_pins_every_runtime_dependency_within_pyproject_ranges() -> None:
    """deploy/requirements.lock: one exact version per package, each of pyproject's
    runtime dependencies pinned inside its range, and nothing of dev or bench."""
    pins = locked()
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for spec in project["dependencies"]:
        requirement = Requirement(spec)
        name = canonicalize_name(requirement.name)
        if name in FIRST_PARTY:
            assert name not in pins, f"{name} is built from this repository, not locked"
            continue
        assert name in pins, f"{name} is not locked"
        assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name])
    for tool in ("pytest", "ruff", "mypy", "hypothesis", "grpcio-tools", "langgraph"):
        assert tool not in pins, f"{tool} is a development tool, not a runtime dependency"


@pytest.mark.parametrize("image", ["transition", "approval"])
def test_images_build_with_the_lock_and_install_nothing_else(image: str) -> None:
    commands = dockerfile.parse_file(str(DEPLOY / "docker" / f"{image}.Dockerfile"))
    copies = [c.value[0] for c in commands if c.cmd == "COPY" and not c.flags]
    assert "deploy/requirements.lock" in copies
    runs = [" ".join(c.value) for c in commands if c.cmd == "RUN" and "pip " in " ".join(c.value)]
    wheel, install = runs
    assert "pip wheel" in wheel
    assert "--constraint requirements.lock" in wheel  # every wheel at its locked version
    assert "--no-index" in install  # the final stage installs only those wheels
    ignore = (DEPLOY / "docker" / f"{image}.Dockerfile.dockerignore").read_text()
    assert "!deploy/requirements.lock" in ignore.splitlines()


def _in_context(relative: str, patterns: list[str]) -> bool:
    """Whether .dockerignore ``patterns`` leave ``relative`` (a file path) in the build
    context: the last pattern matching the path or one of its folders decides."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    kept = True
    for pattern in patterns:
        exception = pattern.startswith("!")
        body = pattern.removeprefix("!").rstrip("/")
        if any(fnmatch.fnmatchcase(prefix, body) for prefix in prefixes):
            kept = exception
    return kept


@pytest.mark.parametrize("image", ["transition", "approval"])
def test_the_build_stage_builds_both_wheels_from_the_build_context(
    image: str, tmp_path: Path
) -> None:
    """The build stage, without Docker: the files its .dockerignore leaves in the
    context, copied as its COPY commands say, then its `pip wheel` (offline: no
    dependencies, no build isolation). Before, the context lacked contract/,
    ztate_langgraph/ and testing/, which the two packages hold: the image could not
    be built."""
    ignore = (DEPLOY / "docker" / f"{image}.Dockerfile.dockerignore").read_text()
    patterns = [line for line in ignore.splitlines() if line and not line.startswith("#")]
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True
    ).stdout.decode()
    context = [path for path in tracked.split("\0") if path and _in_context(path, patterns)]
    assert not [path for path in context if path.startswith(("deploy/secrets", ".ztate"))]
    commands = dockerfile.parse_file(str(DEPLOY / "docker" / f"{image}.Dockerfile"))
    build = commands[: [c.cmd for c in commands].index("FROM", 1)]
    workdir = tmp_path / "src"
    workdir.mkdir()
    for copy in (c for c in build if c.cmd == "COPY"):
        *sources, target = copy.value
        for source in sources:
            for path in context:
                if path == source:  # a file: into a folder (a trailing /) or as named
                    named = target.endswith("/")
                    destination = workdir / target / Path(path).name if named else workdir / target
                elif path.startswith(source.rstrip("/") + "/"):  # a folder's contents
                    destination = workdir / target / path[len(source.rstrip("/")) + 1 :]
                else:
                    continue
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(REPO / path, destination)
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(wheels),
            "./worker_sdk",
            ".",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert sorted(p.name.split("-")[0] for p in wheels.glob("*.whl")) == ["ztate", "ztate_worker"]
