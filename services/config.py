"""Typed configuration, read once at start-up from the environment.

Every setting is ``ZTATE_<NAME>``, except the database address, which is the
conventional ``DATABASE_URL``. Paths default to the development layout under
``ZTATE_HOME`` (``.ztate/``) that ``ztate run`` creates.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Configuration of the transition service."""

    model_config = SettingsConfigDict(env_prefix="ZTATE_", extra="ignore", frozen=True)

    home: Path = Field(default=Path(".ztate"), description="where dev state lives")
    database_url: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("DATABASE_URL", "ZTATE_DATABASE_URL"),
        description="Postgres DSN; unset starts an embedded Postgres under <home>/pg",
    )
    listen: str = Field(default="127.0.0.1:7443", description="host:port of the gRPC server")
    trust_domain: str = Field(default="ztate.local", pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    policy_path: Path | None = Field(
        default=None, description="a policy file, or a folder of them (one per workflow)"
    )
    hmac_keyring_file: Path | None = None
    hmac_keyring: SecretStr | None = Field(
        default=None, description="keyring JSON (overrides file)"
    )
    max_patch_bytes: int = Field(default=64 * 1024, gt=0, le=4 * 1024 * 1024)
    max_depth: int = Field(default=32, gt=0, le=128)
    db_pool_size: int = Field(default=16, gt=0, le=512)
    db_role: str = Field(default="ztate_transition", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    db_reader_role: str = Field(default="ztate_reader", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    head_cache_size: int = Field(default=10_000, ge=0)

    @model_validator(mode="after")
    def _derive_paths(self) -> Settings:
        certs = self.home / "certs"
        defaults = {
            "tls_cert": certs / "service-transition.crt",
            "tls_key": certs / "service-transition.key",
            "tls_ca": certs / "ca.crt",
            "policy_path": self.home / "policy.yaml",
            "hmac_keyring_file": self.home / "keys" / "hmac-keyring.json",
        }
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        return self

    @property
    def max_message_bytes(self) -> int:
        """gRPC's own bound: a patch at the limit plus room for the other fields."""
        return self.max_patch_bytes + 64 * 1024
