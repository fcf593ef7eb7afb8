"""Typed configuration, read once at start-up from the environment.

Every setting is ``ZTATE_<NAME>``, except the database address, which is the
conventional ``DATABASE_URL``. Paths default to the development layout under
``ZTATE_HOME`` (``.ztate/``) that ``ztate run`` creates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

TelemetryMode = Literal["off", "otlp", "console"]
REVOCATION_LIST = "revocations.json"  # beside ca.crt in the development layout
LogFormat = Literal["text", "json"]


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:9464`` for IPv6; port 0 picks a free one)."""
    host, colon, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not host:port")
    return host, int(port)


class TelemetrySettings(BaseSettings):
    """Traces, metrics and logs (``ztate.services.runtime.telemetry``), read under the same
    variables by both services: ``ZTATE_TELEMETRY``, ``ZTATE_OTLP_*``,
    ``ZTATE_LOG_FORMAT``; the endpoint also from the standard
    ``OTEL_EXPORTER_OTLP_ENDPOINT``."""

    telemetry: TelemetryMode | None = Field(
        default=None,
        validation_alias=AliasChoices("ZTATE_TELEMETRY"),
        description="off, otlp or console; unset: otlp when an endpoint is set, else off",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("ZTATE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="OTLP/gRPC collector, e.g. https://collector:4317",
    )
    otlp_insecure: bool = Field(
        default=False,
        validation_alias=AliasChoices("ZTATE_OTLP_INSECURE"),
        description="plaintext gRPC to the collector (a local sidecar only)",
    )
    otlp_ca_file: Path | None = Field(
        default=None,
        validation_alias=AliasChoices("ZTATE_OTLP_CA_FILE"),
        description="CA bundle the collector's certificate is verified with; unset: system roots",
    )
    log_format: LogFormat = Field(default="text", validation_alias=AliasChoices("ZTATE_LOG_FORMAT"))
    metrics_interval_seconds: float = Field(
        default=15.0, gt=0, validation_alias=AliasChoices("ZTATE_METRICS_INTERVAL_SECONDS")
    )
    metrics_listen: str | None = Field(
        default=None,
        validation_alias=AliasChoices("ZTATE_METRICS_LISTEN"),
        description="host:port of a Prometheus scrape endpoint (GET /metrics only); unset: none",
    )

    @field_validator("metrics_listen")
    @classmethod
    def _check_metrics_listen(cls, value: str | None) -> str | None:
        if value:
            parse_listen(value)
        return value or None

    @model_validator(mode="after")
    def _check_telemetry(self) -> TelemetrySettings:
        if self.telemetry == "otlp" and not self.otlp_endpoint:
            raise ValueError(
                "ZTATE_TELEMETRY=otlp needs ZTATE_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_ENDPOINT)"
            )
        return self

    @property
    def telemetry_mode(self) -> TelemetryMode:
        if self.telemetry is not None:
            return self.telemetry
        return "otlp" if self.otlp_endpoint else "off"


class Settings(TelemetrySettings):
    """Configuration of the transition service."""

    model_config = SettingsConfigDict(
        env_prefix="ZTATE_", extra="ignore", frozen=True, populate_by_name=True
    )

    home: Path = Field(default=Path(".ztate"), description="where dev state lives")
    database_url: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("DATABASE_URL", "ZTATE_DATABASE_URL"),
        description="Postgres DSN; unset starts an embedded Postgres under <home>/pg",
    )
    listen: str = Field(default="127.0.0.1:7443", description="host:port of the gRPC server")

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        # host:port (":port": every interface), the port 0-65535: refused at start-up
        parse_listen(f"0.0.0.0{value}" if value.startswith(":") else value)  # noqa: S104
        return value

    trust_domain: str = Field(default="ztate.local", pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    revocation_list_file: Path | None = Field(
        default=None,
        description="revoked certificates and identities (JSON), read again when it changes",
    )
    policy_path: Path | None = Field(
        default=None, description="a policy file, or a folder of them (one per workflow)"
    )
    hmac_keyring_file: Path | None = None
    hmac_keyring: SecretStr | None = Field(
        default=None, description="keyring JSON (overrides file)"
    )
    max_patch_bytes: int = Field(default=64 * 1024, gt=0, le=4 * 1024 * 1024)
    max_state_bytes: int = Field(
        default=1024 * 1024,
        gt=0,
        le=64 * 1024 * 1024,
        description="a change that would make a thread's state larger is refused",
    )
    handshake_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        le=120,
        description="close a connection that has not completed TLS within this (s)",
    )
    max_connection_age_seconds: float = Field(
        default=3600.0,
        gt=0,
        le=7 * 86_400,
        description="a connection is closed after this long (with a grace for its calls and "
        "streams) so that its client connects again and is checked from scratch by TLS: a "
        "CA removed from the bundle stops connections made under it",
    )
    max_depth: int = Field(default=32, gt=0, le=128)
    db_pool_size: int = Field(default=16, gt=0, le=512)
    db_role: str = Field(default="ztate_transition", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    db_reader_role: str = Field(default="ztate_reader", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    ledger_query_timeout_seconds: float = Field(
        default=10.0,
        ge=0.001,
        le=3600,
        description="an operator's ledger query (ListRejections, ListTransitions, ...) "
        "running longer is cancelled and refused QUERY_TOO_COSTLY",
    )
    head_cache_size: int = Field(default=10_000, ge=0)
    approval_target: str | None = Field(
        default=None, description="host:port of the approval service; unset: parked stay parked"
    )
    approval_server_name: str | None = None
    approval_public_keys_file: Path | None = None
    pending_ttl_seconds: int = Field(default=24 * 3600, gt=0)
    outbox_interval_seconds: float = Field(default=2.0, gt=0)
    checkpoint_key_file: Path | None = Field(
        default=None, description="Ed25519 key that signs head checkpoints; absent: none"
    )
    checkpoint_key_id: str = Field(default="checkpoint-k1", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    checkpoint_public_keys_file: Path | None = None
    checkpoint_interval_seconds: float = Field(default=60.0, gt=0)
    checkpoint_journal_file: Path | None = Field(
        default=None,
        description="the signer's own append-only record of what it signed, outside the "
        "database (docs/verification.md); default $ZTATE_HOME/checkpoints/journal.jsonl",
    )
    service_name: str = Field(
        default="ztate-transition",
        validation_alias=AliasChoices("ZTATE_SERVICE_NAME", "OTEL_SERVICE_NAME"),
        description="service.name of traces, metrics and logs",
    )
    watch_max_streams: int = Field(
        default=256, ge=0, le=100_000, description="WatchThread streams served at once"
    )
    watch_max_streams_per_identity: int = Field(
        default=32, ge=1, le=100_000, description="WatchThread streams one identity may hold"
    )
    watch_max_stream_seconds: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="a watch stream ends (OK) after this long; the client resumes, re-checked",
    )
    work_lease_seconds: float = Field(
        default=30.0,
        ge=0.5,
        le=3600,
        description="a SubscribeWork lease lapses after this long unless renewed",
    )
    work_poll_seconds: float = Field(
        default=2.0,
        ge=0.05,
        le=60,
        description="how often each replica looks for work nobody holds (one query, "
        "whatever the number of subscribers)",
    )
    health_interval_seconds: float = Field(
        default=2.0, gt=0, le=60, description="how often the database is pinged for gRPC health"
    )
    health_timeout_seconds: float = Field(
        default=2.0, gt=0, le=30, description="a ping slower than this reports NOT_SERVING"
    )
    migrate_on_start: bool = Field(
        default=True,
        description="apply pending migrations at start-up (needs CREATE on schema public); "
        "false: only check the schema is at this version (a migration job ran)",
    )

    @model_validator(mode="after")
    def _derive_paths(self) -> Settings:
        certs = self.home / "certs"
        defaults = {
            "tls_cert": certs / "service-transition.crt",
            "tls_key": certs / "service-transition.key",
            "tls_ca": certs / "ca.crt",
            "revocation_list_file": certs / REVOCATION_LIST,
            "policy_path": self.home / "policy.yaml",
            "hmac_keyring_file": self.home / "keys" / "hmac-keyring.json",
            "approval_public_keys_file": self.home / "keys" / "approval-public.json",
            "checkpoint_key_file": self.home / "keys" / "checkpoint-signing.pem",
            "checkpoint_public_keys_file": self.home / "keys" / "checkpoint-public.json",
            "checkpoint_journal_file": self.home / "checkpoints" / "journal.jsonl",
        }
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        return self

    @model_validator(mode="after")
    def _state_holds_a_patch(self) -> Settings:
        if self.max_state_bytes < self.max_patch_bytes:
            raise ValueError(
                "max_state_bytes must be at least max_patch_bytes: a state holds its patches"
            )
        return self

    @property
    def max_message_bytes(self) -> int:
        """gRPC's bound on requests: a patch at the limit plus room for the other fields."""
        return self.max_patch_bytes + 64 * 1024

    @property
    def max_reply_bytes(self) -> int:
        """gRPC's bound on replies, derived from the limits: the largest reply is a
        transition's detail (its record, holding the patch, its patch again, the state
        at the limit, a receipt) or a view or watched version of a state at the limit.
        A revert's patch is the whole state it restores, up to the state limit, not the
        patch limit: with 2 x the patch limit, a revert's detail could never be read."""
        largest_patch = max(self.max_patch_bytes, self.max_state_bytes)
        return self.max_state_bytes + 2 * largest_patch + 64 * 1024


def _shared(name: str) -> AliasChoices:
    """Settings both services read under the same variable (ZTATE_HOME, ...)."""
    return AliasChoices(f"ZTATE_{name.upper()}")


class ApprovalSettings(TelemetrySettings):
    """Configuration of the approval service (``ZTATE_APPROVAL_*``; the home, the
    database and the trust domain are shared with the transition service)."""

    model_config = SettingsConfigDict(
        env_prefix="ZTATE_APPROVAL_", extra="ignore", frozen=True, populate_by_name=True
    )

    metrics_listen: str | None = Field(
        default=None,
        validation_alias=AliasChoices("ZTATE_APPROVAL_METRICS_LISTEN", "ZTATE_METRICS_LISTEN"),
        description="host:port of a Prometheus scrape endpoint (GET /metrics only); unset: none",
    )
    home: Path = Field(default=Path(".ztate"), validation_alias=_shared("home"))
    database_url: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("DATABASE_URL", "ZTATE_DATABASE_URL")
    )
    trust_domain: str = Field(
        default="ztate.local",
        pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$",
        validation_alias=_shared("trust_domain"),
    )
    listen: str = Field(default="127.0.0.1:7444", description="host:port of the gRPC server")

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        # host:port (":port": every interface), the port 0-65535: refused at start-up
        parse_listen(f"0.0.0.0{value}" if value.startswith(":") else value)  # noqa: S104
        return value

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    revocation_list_file: Path | None = Field(
        default=None,
        description="revoked certificates and identities (JSON), read again when it changes",
    )
    signing_key_file: Path | None = None
    key_id: str = Field(default="approval-k1", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    transition_target: str = Field(
        default="127.0.0.1:7443", description="where decisions are delivered"
    )
    transition_server_name: str | None = None
    db_role: str = Field(default="ztate_approver", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    db_pool_size: int = Field(default=8, gt=0, le=256)
    handshake_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        le=120,
        description="close a connection that has not completed TLS within this (s)",
    )
    max_connection_age_seconds: float = Field(
        default=3600.0,
        gt=0,
        le=7 * 86_400,
        description="a connection is closed after this long (with a grace for its calls and "
        "streams) so that its client connects again and is checked from scratch by TLS: a "
        "CA removed from the bundle stops connections made under it",
    )
    review_ttl_seconds: int = Field(default=24 * 3600, gt=0)
    receipt_ttl_seconds: int = Field(default=600, gt=0)
    outbox_interval_seconds: float = Field(default=2.0, gt=0)
    health_interval_seconds: float = Field(default=2.0, gt=0, le=60)
    health_timeout_seconds: float = Field(default=2.0, gt=0, le=30)
    migrate_on_start: bool = True  # false: only check the schema (see Settings)
    webhook_url: str | None = None
    webhook_secret: SecretStr | None = None
    service_name: str = Field(
        default="ztate-approval",
        validation_alias=AliasChoices("ZTATE_APPROVAL_SERVICE_NAME", "OTEL_SERVICE_NAME"),
        description="service.name of traces, metrics and logs",
    )

    @model_validator(mode="after")
    def _derive_paths(self) -> ApprovalSettings:
        certs = self.home / "certs"
        defaults = {
            "tls_cert": certs / "service-approval.crt",
            "tls_key": certs / "service-approval.key",
            "tls_ca": certs / "ca.crt",
            "revocation_list_file": certs / REVOCATION_LIST,
            "signing_key_file": self.home / "approval" / "signing-key.pem",
        }
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if (self.webhook_url is None) != (self.webhook_secret is None):
            raise ValueError("set both ZTATE_APPROVAL_WEBHOOK_URL and _WEBHOOK_SECRET, or neither")
        return self


def describe(error: ValidationError) -> str:
    """A configuration error as the operator fixes it: by variable name."""
    return "; ".join(
        f"ZTATE_{'_'.join(str(p) for p in err['loc']).upper()}: {err['msg']}"
        for err in error.errors()
    )
