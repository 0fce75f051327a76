"""Daemon settings, from the environment (systemd's directories first) with overrides."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, field_validator


def default_state_dir() -> Path:
    """Where the ledger lives, for the daemon and the offline CLI alike.

    $TALLY_STATE_DIR, else systemd's $STATE_DIRECTORY (its first entry), else
    $XDG_STATE_HOME/tally, else ~/.local/state/tally.
    """
    for name in ("TALLY_STATE_DIR", "STATE_DIRECTORY"):
        if os.environ.get(name):
            return Path(os.environ[name].split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tally"


_state_dir = default_state_dir  # the name callers used before it was public


def default_runtime_dir() -> Path:
    """Where the socket lives; the daemon and its clients must derive the same place.

    IDE launchers start the MCP adapter with a sparse environment (no XDG_RUNTIME_DIR), so the
    fallback is the per-user /run/user/<uid> that systemd's user manager creates, if present.
    """
    for name in ("TALLY_RUNTIME_DIR", "RUNTIME_DIRECTORY"):
        if os.environ.get(name):
            return Path(os.environ[name].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "tally"
    user_run = Path(f"/run/user/{os.getuid()}")
    if user_run.is_dir():
        return user_run / "tally"
    return Path(f"/tmp/tally-{os.getuid()}")


def default_socket_path() -> Path:
    return default_runtime_dir() / "tally.sock"


class Settings(BaseModel):
    # an error never echoes a value: `ledger_url` (and `otlp_headers`) may hold a secret
    model_config = ConfigDict(frozen=True, hide_input_in_errors=True)

    state_dir: Path
    runtime_dir: Path
    socket_path: Path
    tcp: str | None = Field(default=None, pattern=r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}$")
    """Opt-in TCP bind ("ADDR:PORT"); None = unix socket only. Beyond loopback it needs `tls`
    or `insecure_http` (`daemon.tls.bind_refusal`)."""
    tls: bool = False
    """Serve the TCP listener over TLS (HTTPS)."""
    tls_cert: Path | None = None
    """The operator's certificate chain (PEM); None with `tls` = the state dir's self-signed."""
    tls_key: Path | None = None
    host_names: tuple[str, ...] = ()
    """Names clients reach the listener by (the Host check and the certificate's SANs)."""
    insecure_http: bool = False
    """Serve plain HTTP beyond loopback (witnessed at start, shown in `health`)."""
    roster_path: Path | None = None
    """None = the packaged default roster."""
    roster_dirs: tuple[Path, ...] = ()
    """Besides the roster's own directory, where `roster_reload` may read another roster."""
    body_limit: int = 1024 * 1024
    checkpoint_interval_s: float = 60.0
    snapshot_interval_s: float = 60.0
    """How often the run-state snapshot (bounded start-up) is rewritten, if the ledger grew."""
    drain_s: float = 5.0
    """On stop, how long running runs may finish before they are interrupted (resumable)."""
    coordinator: str | None = None
    """Tier or member that plans requests without a client plan; None = one task per run."""
    judge: str | None = None
    """Tier or member that judges task outputs after their assertions; None = no judge."""
    max_tasks: int = 256
    """Tasks in flight across all runs."""
    workspace_roots: tuple[Path, ...] = ()
    """Directories a run's workspace may lie in (`tally serve --workspace-root`), besides the
    roster's `[policy.workspace] roots`; none by default."""
    otlp_endpoint: str | None = None
    """OpenTelemetry traces URL (OTLP/HTTP); None = no traces. See daemon.tracing."""
    otlp_headers: tuple[tuple[str, str], ...] = ()
    otel_capture_content: bool = False
    """Put prompts and replies in the chat spans (off by default)."""
    ledger_url: str | None = None
    """The shared record on PostgreSQL (`--ledger postgresql://…`, `TALLY_LEDGER`); None = the
    file ledger in the state dir. See `daemon.ledger.shared`."""

    @field_validator("ledger_url")
    @classmethod
    def _postgresql(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgresql://", "postgres://")):
            scheme = value.partition("://")[0][:20] if "://" in value else "a text"
            raise ValueError(
                f"--ledger (or $TALLY_LEDGER) names {scheme!r}, not a PostgreSQL URL: use "
                "postgresql://… (the file ledger in the state dir is the default)"
            )
        return value

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        state_dir = Path(overrides.pop("state_dir", None) or _state_dir())
        runtime_dir = Path(overrides.pop("runtime_dir", None) or default_runtime_dir())
        socket_path = Path(
            overrides.pop("socket_path", None)
            or os.environ.get("TALLY_SOCKET")  # the clients' variable: both ends meet
            or runtime_dir / "tally.sock"
        )
        if "TALLY_TCP" in os.environ and "tcp" not in overrides:
            overrides["tcp"] = os.environ["TALLY_TCP"] or None
        if os.environ.get("TALLY_ROSTER_DIRS") and "roster_dirs" not in overrides:
            overrides["roster_dirs"] = tuple(
                Path(p) for p in os.environ["TALLY_ROSTER_DIRS"].split(":") if p
            )
        if "TALLY_ROSTER" in os.environ and "roster_path" not in overrides:
            overrides["roster_path"] = Path(os.environ["TALLY_ROSTER"])
        if "otlp_endpoint" not in overrides:
            overrides.update(_otel_from_env())
        if os.environ.get("TALLY_LEDGER") and "ledger_url" not in overrides:
            overrides["ledger_url"] = os.environ["TALLY_LEDGER"]
        return cls(
            state_dir=state_dir, runtime_dir=runtime_dir, socket_path=socket_path, **overrides
        )


def _otel_from_env() -> dict[str, Any]:
    """The standard OpenTelemetry variables, read only when the caller sets none itself."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return {}
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    if not endpoint:
        return {}
    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS", "")
    headers = tuple(
        (name.strip(), unquote(value.strip()))
        for name, sep, value in (pair.partition("=") for pair in raw.split(","))
        if sep and name.strip()
    )
    capture = env.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").lower() == "true"
    return {"otlp_endpoint": endpoint, "otlp_headers": headers, "otel_capture_content": capture}
