"""Pydantic models of the roster file. Loading with located errors lives in roster.loading.

One piece past 500 lines: the models' cross-field validators read one another (members, tiers,
lanes, policy), so they are checked and read together."""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

PLACEHOLDERS = ("{python}", "{model}", "{port}", "{slots}", "{ctx}")
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")
NAME = r"^[a-z0-9][a-z0-9_.-]*$"
_VKEY = re.compile(r"^[^+\s]{1,255}\+[0-9a-f]{8}\+[A-Za-z0-9+/]{40,60}={0,2}$")

# Every number a roster (or a client's budget) can set is finite and bounded: they reach
# timers, counters and the ledger, which holds integers within ±(2**53 - 1) only.
MAX_SAFE_INT = 2**53 - 1
DAY_S = 86_400.0


def _whole(value: Any) -> Any:
    # JSON Schema's `integer` is any number without a fraction, so 3.0 is 3; 3.5, "3" and
    # true are still refused by the strict int after this.
    if type(value) is float and value.is_integer():
        return int(value)
    return value


Whole = BeforeValidator(_whole)
"""Marks an int as JSON Schema's integer (3.0 included, no other coercion). It goes after the
bounds: `Annotated[int, Field(ge=1, le=9), Whole]`, so the schema says minimum and maximum."""


class _Strict(BaseModel):
    # strict: TOML has real types, so `slots = "4"` or `wall_s = true` is a mistake to report.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Sampling(_Strict):
    """Sent with every request to a member; unset fields are left to the server."""

    temperature: float | None = Field(default=None, ge=0, le=5)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: Annotated[int, Field(ge=0, le=1_000_000), Whole] | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repeat_penalty: float | None = Field(default=None, gt=0, le=100)
    seed: Annotated[int, Field(ge=-(2**31), le=2**32 - 1), Whole] | None = Field(
        default=None, description="-1: random."
    )


class Member(_Strict):
    """A pool member: a model server tally spawns from `command`, or an external `url`; or,
    with `kind = "agent-cli"`, a coding-agent command line run in the sandbox on a task's view
    (see `AGENT_CLI_FIELDS` and `daemon.runs.agentcli`)."""

    name: str = Field(pattern=NAME)
    kind: Literal["server", "agent-cli"] | None = None
    """None or "server": a model server. "agent-cli": `argv` is run per task instead."""
    command: list[str] | None = None
    model: str | None = None
    model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    url: str | None = None
    model_id: str | None = None
    api_key_env: str | None = None
    slots: Annotated[int, Field(ge=1, le=256), Whole] = 1
    ctx: Annotated[int, Field(ge=256, le=1 << 24), Whole] = 4096
    instances: Annotated[int, Field(ge=1, le=64), Whole] = 1
    idle_unload_s: float | None = Field(default=None, gt=0, le=30 * DAY_S)
    ready_timeout_s: float = Field(default=60.0, gt=0, le=DAY_S)
    request_timeout_s: float = Field(default=300.0, gt=0, le=DAY_S)
    max_reply_mb: Annotated[int, Field(ge=1, le=1024), Whole] = 16
    """The most one reply of this member may hold (a chat reply, its streamed text and tool
    calls, an embeddings answer); a chat reply is also capped by its `max_tokens`. Past it
    the call fails as the member's fault."""
    sampling: Sampling = Sampling()
    tally: bool = False
    """The `url` is another tally daemon's gateway (`http://host:port/v1`): each call records
    where that daemon's ledger has it, and `tally ledger verify --remote` proves it there."""
    tally_key: str | None = Field(default=None, max_length=512)
    """That daemon's checkpoint verifier key (`tally ledger key` prints it), pinned here."""
    cosign: bool = False
    """Ask this tally daemon to cosign our checkpoints (C2SP tlog-cosignature): it checks each
    against the last one it cosigned for us. It must list us as a tally member too."""
    tls_fingerprint: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")
    """An https `url`'s certificate, pinned: exactly this one is accepted (self-signed is
    fine); `tally cert` on that machine prints it."""
    tls_ca: str | None = Field(default=None, max_length=4096)
    """An https `url` is verified against this CA bundle (an absolute path) and its name."""
    # --- agent-cli members only (kind = "agent-cli"; see `daemon.runs.agentcli`) ---
    argv: list[Annotated[str, Field(max_length=4096)]] | None = Field(
        default=None, min_length=1, max_length=256
    )
    """The command line, never through a shell: a program (a name found on PATH or an
    absolute path) and its arguments, with the placeholders `{prompt}` (prompt = "arg"),
    `{prompt_file}` (prompt = "file") and `{workspace}` (the task's view)."""
    prompt: Literal["stdin", "file", "arg"] | None = None
    """How the CLI gets the task's prompt; None = "stdin"."""
    env: list[Annotated[str, Field(max_length=128)]] | None = Field(default=None, max_length=64)
    """Names of the daemon's environment variables the CLI gets (an API key's name, never its
    value); their values are never recorded."""
    set_env: dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=4096)]] | (
        None
    ) = Field(default=None, max_length=64)
    """Variables set to these values (configuration, never secrets: those go in `env`)."""
    network: bool | None = None
    """The CLI may reach the network (a cloud model, tally's own TCP gateway); default no."""
    ro_binds: list[str] | None = Field(default=None, max_length=64)
    """Paths the CLI sees read-only: its own install and config (`~/` is the daemon's home).
    Never the state dir, the runtime dir, the key, or the home dir itself."""
    version_argv: list[Annotated[str, Field(max_length=4096)]] | None = Field(
        default=None, min_length=1, max_length=64
    )
    """What `tally doctor` runs in the sandbox to see the CLI answer; None = program --version."""

    @field_validator("command")
    @classmethod
    def _command_template(cls, command: list[str] | None) -> list[str] | None:
        # A field validator (not the model validator) so the error is located at `command`.
        if command is None:
            return None
        if not command:
            raise ValueError("'command' must not be empty")
        if not any("{port}" in part for part in command):
            raise ValueError("'command' template must contain {port}")
        unknown = sorted(
            {p for part in command for p in _PLACEHOLDER.findall(part)} - set(PLACEHOLDERS)
        )
        if unknown:
            raise ValueError(
                f"unknown placeholder {', '.join(unknown)} (known: {', '.join(PLACEHOLDERS)})"
            )
        return command

    @field_validator("url")
    @classmethod
    def _server_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("'url' must be an http:// or https:// server URL with a host")
        if any(c.isspace() for c in url) or parts.query or parts.fragment or parts.username:
            raise ValueError("'url' is a server's base URL: no spaces, query, fragment or user")
        try:
            parts.port  # noqa: B018  (raises ValueError on a bad port)
        except ValueError:
            raise ValueError("'url' has a bad port") from None
        return url

    @field_validator("argv", "version_argv")
    @classmethod
    def _cli_argv(cls, argv: list[str] | None) -> list[str] | None:
        return None if argv is None else cli_argv(argv)

    @field_validator("env")
    @classmethod
    def _env_names(cls, names: list[str] | None) -> list[str] | None:
        for name in names or []:
            env_name(name)
            if "=" in name:
                raise ValueError(f"{name[:40]!r}: `env` lists names only")
        return names

    @field_validator("set_env")
    @classmethod
    def _set_env(cls, values: dict[str, str] | None) -> dict[str, str] | None:
        for name, value in (values or {}).items():
            env_name(name)
            if _SECRET_NAME.search(name) or _SECRET_VALUE.search(value):
                raise ValueError(
                    f"{name!r} looks like a secret: a secret does not belong in the roster "
                    "(it would be readable by anyone who reads it): export it in the daemon's "
                    f"environment and list its name in `env = [{name!r}]`"
                )
            if "\x00" in value:
                raise ValueError(f"{name!r}: a NUL byte in its value")
        return values

    @field_validator("ro_binds")
    @classmethod
    def _cli_binds(cls, paths: list[str] | None) -> list[str] | None:
        for path in paths or []:
            cli_bind(path)
        return paths

    @model_validator(mode="after")
    def _spawned_or_external(self) -> Member:
        if self.kind == "agent-cli":
            return self._agent_cli()
        cli_only = [f for f in AGENT_CLI_FIELDS if getattr(self, f) is not None]
        if cli_only:
            raise ValueError(
                f"{', '.join(map(repr, cli_only))} belong to agent-cli members: add "
                "kind = \"agent-cli\", or use 'command' (spawned) or 'url' (external)"
            )
        if (self.command is None) == (self.url is None):
            raise ValueError(
                "a member needs exactly one of 'command' (spawned) or 'url' (external)"
            )
        uses_model = self.command is not None and any("{model}" in p for p in self.command)
        if uses_model and self.model is None:
            raise ValueError("'command' uses {model} but no 'model' is given")
        if self.tally and (self.url is None or self.tally_key is None):
            raise ValueError(
                "a 'tally = true' member needs 'url' (the other daemon's /v1) and 'tally_key' "
                "(its verifier key, from `tally ledger key` there)"
            )
        if self.cosign and not self.tally:
            raise ValueError("'cosign = true' needs 'tally = true' (a tally daemon cosigns)")
        if self.tally_key is not None and not _VKEY.match(self.tally_key):
            raise ValueError("'tally_key' must be a C2SP verifier key: name+hexid+base64")
        if self.tls_fingerprint is not None or self.tls_ca is not None:
            if self.url is None or not self.url.startswith("https://"):
                raise ValueError("'tls_fingerprint' and 'tls_ca' need an https:// 'url'")
            if self.tls_fingerprint is not None and self.tls_ca is not None:
                raise ValueError("give one of 'tls_fingerprint' (a pin) or 'tls_ca' (a CA)")
            if self.tls_ca is not None and not Path(self.tls_ca).is_absolute():
                raise ValueError("'tls_ca' must be an absolute path to a PEM CA bundle")
        return self

    def _agent_cli(self) -> Member:
        server = [
            f
            for f in ("command", "url", "model", "model_sha256", "model_id", "api_key_env")
            if getattr(self, f) is not None
        ]
        server += [f for f in ("tally_key", "tls_fingerprint", "tls_ca") if getattr(self, f)]
        if self.tally:
            server.append("tally")
        if server:
            raise ValueError(
                f"an agent-cli member runs 'argv', not a server: remove {', '.join(server)}"
            )
        if self.argv is None:
            raise ValueError(
                'an agent-cli member needs \'argv\', e.g. argv = ["llm", "-m", "MODEL"]'
            )
        used = {p for part in self.argv for p in _PLACEHOLDER.findall(part)}
        how = self.prompt or "stdin"
        wanted = {"file": "{prompt_file}", "arg": "{prompt}"}.get(how)
        if wanted is not None and wanted not in used:
            raise ValueError(f"prompt = {how!r} but 'argv' has no {wanted} to put it in")
        for other in ("{prompt}", "{prompt_file}"):
            if other in used and other != wanted:
                raise ValueError(
                    f"'argv' uses {other} but prompt = {how!r}: set prompt = "
                    f"{'arg' if other == '{prompt}' else 'file'!r}"
                )
        if self.version_argv is not None:
            extra = {p for part in self.version_argv for p in _PLACEHOLDER.findall(part)}
            if extra:
                raise ValueError(f"'version_argv' takes no placeholders (got {sorted(extra)})")
        return self

    @property
    def external(self) -> bool:
        return self.url is not None

    @property
    def agent_cli(self) -> bool:
        return self.kind == "agent-cli"


AGENT_CLI_FIELDS = ("argv", "prompt", "env", "set_env", "network", "ro_binds", "version_argv")
CLI_PLACEHOLDERS = ("{prompt}", "{prompt_file}", "{workspace}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_SANDBOX_ENV = frozenset(("HOME", "TMPDIR"))
# A literal credential in a roster: common key prefixes, a bearer header, or an option that
# names a secret with a value glued on. They would be recorded with the argv; refused.
_SECRET_VALUE = re.compile(
    r"(?:^|[\s=:])(?:sk-[A-Za-z0-9_-]{12,}|sk_(?:live|test)_\w{8,}|gh[pousr]_\w{20,}|"
    r"github_pat_\w{20,}|xox[abprs]-[\w-]{10,}|AKIA[0-9A-Z]{16}|AIza[\w-]{30,}|"
    r"hf_[A-Za-z0-9]{20,}|glpat-[\w-]{20,})|^(?:Bearer|Basic)\s+\S{8,}",
    re.I,
)
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.I)
_SECRET_OPTION = re.compile(
    r"^--?(?:[A-Za-z0-9]+[-_])*(?:api[-_]?key|key|token|secret|password|passwd|credentials?)"
    r"(?:=(?P<value>.*))?$",
    re.I,
)
_UNBINDABLE = ("/proc", "/sys", "/dev", "/run", "/var/run")
_UNBINDABLE_ITSELF = ("/", "~", "/tmp", "/home", "/root", "/var", "/usr")


def env_name(name: str) -> str:
    if not _ENV_NAME.match(name):
        raise ValueError(f"{name[:40]!r} is not an environment variable name")
    if name.upper().startswith("TALLY_"):
        raise ValueError(f"{name!r}: the daemon's own settings are never passed to a CLI")
    if name in _SANDBOX_ENV:
        raise ValueError(f"{name!r} is set by the sandbox (the task's view)")
    return name


def cli_argv(argv: list[str]) -> list[str]:
    """An agent CLI's argv, refused when it could not run as meant or would record a secret."""
    program = argv[0]
    if not program.strip() or program != program.strip():
        raise ValueError("the program (argv[0]) is blank or has surrounding spaces")
    if "/" in program and not program.startswith("/"):
        raise ValueError(
            f"{program[:60]!r}: the program is a name found on PATH or an absolute path"
        )
    if _PLACEHOLDER.search(program):
        raise ValueError("the program (argv[0]) cannot be a placeholder")
    for i, part in enumerate(argv):
        if "\x00" in part:
            raise ValueError(f"argv[{i}] holds a NUL byte")
        unknown = sorted(set(_PLACEHOLDER.findall(part)) - set(CLI_PLACEHOLDERS))
        if unknown:
            raise ValueError(
                f"argv[{i}]: unknown placeholder {', '.join(unknown)} "
                f"(known: {', '.join(CLI_PLACEHOLDERS)})"
            )
        option = _SECRET_OPTION.match(part)
        glued = option is not None and option["value"] not in (None, "")
        follows = i > 0 and _SECRET_OPTION.match(argv[i - 1]) is not None and "=" not in argv[i - 1]
        if _SECRET_VALUE.search(part) or glued or (follows and not _PLACEHOLDER.search(part)):
            raise ValueError(
                f"argv[{i}] looks like a secret, and the argv is recorded with every call: "
                "export it in the daemon's environment, list its name in `env`, and let the "
                "CLI read it from there"
            )
    return argv


def cli_bind(path: str) -> str:
    """A read-only bind of an agent CLI: absolute (or `~/…`), not a system pseudo-dir."""
    body = path[1:] if path.startswith("~/") else path
    if (
        not path.startswith(("/", "~/"))
        or "\x00" in path
        or "/../" in body + "/"
        or "/./" in body + "/"
    ):
        raise ValueError(f"{path[:80]!r}: a bind is an absolute path (or ~/…) without '..'")
    real = path.rstrip("/") or "/"
    if real in _UNBINDABLE_ITSELF or any(
        real == u or real.startswith(u + "/") for u in _UNBINDABLE
    ):
        raise ValueError(
            f"{path!r} is not a place to bind: name the CLI's own install or config dir"
        )
    return path


class Tiers(_Strict):
    """Named tiers, each a list of member names, and the escalation `ladder` (cheap first).

    In TOML every key of `[tiers]` other than `ladder` names a tier:
    `ladder = ["cheap", "capable"]`, `cheap = ["tiny"]`, `capable = ["big"]`.
    """

    ladder: list[str] = Field(min_length=1)
    members: dict[str, list[str]]

    @model_validator(mode="before")
    @classmethod
    def _collect_tiers(cls, data: Any) -> Any:
        if isinstance(data, dict) and "members" not in data:
            rest = {k: v for k, v in data.items() if k != "ladder"}
            return {"ladder": data.get("ladder"), "members": rest}
        return data

    @model_serializer(mode="wrap")
    def _flatten(self, handler: Any) -> dict[str, Any]:
        return {"ladder": list(self.ladder), **{k: list(v) for k, v in self.members.items()}}

    def rung(self, tier: str) -> int:
        return self.ladder.index(tier)


class LaneCheck(_Strict):
    """A lane's default check, run in a task's view after the task when its run has a
    workspace: `run` executes `argv`; `tests` runs the workspace's own tests, detected from
    its files (pytest, npm test, go test, cargo test, make test), and is skipped without any."""

    type: Literal["run", "tests"]
    argv: list[str] | None = Field(default=None, min_length=1, max_length=256)
    timeout_s: float = Field(default=120.0, gt=0, le=DAY_S)

    @model_validator(mode="after")
    def _argv_for_run(self) -> LaneCheck:
        if (self.type == "run") != (self.argv is not None):
            raise ValueError("a 'run' check needs 'argv'; a 'tests' check takes none")
        return self


MAX_LANE_EXAMPLES = 2_000
MAX_EXAMPLES = 20_000
"""Examples across all lanes: the router indexes them all at load (5,000 take ~0.2 s)."""
MAX_EXAMPLE_CHARS = 500
# Characters an example must not hold: controls, and the invisible or reordering ones
# (bidi overrides, zero-width joiners, BOMs, tags) that make a text read unlike its words.
_HIDDEN = frozenset(("Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"))


def _example(text: str) -> str:
    if not text.strip():
        raise ValueError("a blank example")
    if text.isprintable():  # in C: no control, format, private, unassigned or separator
        return _with_a_word(text)
    for offset, char in enumerate(text):
        if unicodedata.category(char) in _HIDDEN and char != "\t":
            raise ValueError(
                f"character U+{ord(char):04X} at offset {offset} is a control or invisible "
                "character: write the request as plain text"
            )
    return _with_a_word(text)


def _with_a_word(text: str) -> str:
    if not any(char.isalnum() for char in text):
        raise ValueError("an example needs at least one letter or digit")
    return text


def _few(value: Any) -> Any:
    # Counted before each item is validated: 100,000 examples are refused at once.
    if isinstance(value, list) and len(value) > MAX_LANE_EXAMPLES:
        raise ValueError(
            f"at most {MAX_LANE_EXAMPLES} examples per lane (got {len(value)}): keep the ones "
            "that teach something"
        )
    return value


Example = Annotated[
    str, Field(min_length=1, max_length=MAX_EXAMPLE_CHARS), AfterValidator(_example)
]
"""One example request of a lane: plain text, at most MAX_EXAMPLE_CHARS characters."""


class Lane(_Strict):
    name: str = Field(pattern=NAME)
    keywords: list[str] = Field(min_length=1)
    phrases: list[str] = []
    negative: list[str] = []
    tier: str
    system: str = Field(min_length=1)
    max_concurrency: Annotated[int, Field(ge=1, le=65_536), Whole] | None = None
    checks: list[LaneCheck] = Field(default=[], max_length=16)
    """Checks every task of this lane gets when its run has a workspace (none elsewhere)."""
    examples: Annotated[list[Example], BeforeValidator(_few)] = Field(
        default=[], max_length=MAX_LANE_EXAMPLES
    )
    """Requests this lane should get, in users' own words: the router scores a request by its
    likeness to them (see daemon.examples), and `tally route --teach` adds to them."""
    agent: Literal["off", "json", "native"] = "off"
    """How this lane's tasks act on a workspace. "off": tally plans them as chat tasks (one
    model call whose answer is edits). "json" / "native": tally plans them, on a run with a
    workspace, as `agent` tasks (a tool-calling loop that reads, edits and runs the tests),
    asking for each tool call as schema-constrained JSON (any llama.cpp server) or as OpenAI
    `tool_calls` (a server with a tool-capable template, `--jinja`; it falls back to JSON if
    the server refuses tools). A client's plan may name `"executor": "agent"` on any lane:
    the lane's "native" or else JSON."""


class Budget(_Strict):
    """Per-run limits; None means unlimited."""

    model_calls: Annotated[int, Field(ge=1, le=1_000_000), Whole] | None = None
    tokens: Annotated[int, Field(ge=1, le=MAX_SAFE_INT), Whole] | None = None
    wall_s: float | None = Field(default=None, gt=0, le=30 * DAY_S)


def _absolute(paths: list[str]) -> list[str]:
    for path in paths:
        if not path.startswith("/") or "\x00" in path or "/../" in path + "/":
            raise ValueError(f"{path!r}: a bind must be an absolute path without '..'")
    return paths


class CommandPolicy(_Strict):
    """The command executor: on or off, for which lanes, and how it is confined.

    `sandbox = "bwrap"` runs every command task in bubblewrap (read-only system dirs, its own
    temporary dir as the only writable path, its own PID namespace, no network unless
    `network`); `"none"` is an explicit, witnessed opt-out.
    """

    enabled: bool = True
    lanes: list[str] | None = None
    """Lanes whose tasks may run commands; None = every lane."""
    sandbox: Literal["bwrap", "none"] = "bwrap"
    network: bool = False
    """Whether a task that asks for the network (`network = true` on the task) may have it."""
    ro_binds: list[str] = Field(default=[], max_length=64)
    """Extra paths a task sees read-only (e.g. a toolchain under the home directory)."""
    rw_binds: list[str] = Field(default=[], max_length=64)
    """Extra paths a task may write (use sparingly: it is a way out of the sandbox)."""
    memory_mb: int = Field(default=2048, ge=16, le=1 << 20)
    """A task's memory budget: its in-memory dirs (`tmpfs_mb`) plus the address-space limit
    of each of its processes (the rest); where a cgroup v2 memory controller is reachable,
    also the task's total (`MemoryMax`, shared memory included)."""
    tmpfs_mb: int | None = Field(default=None, ge=4, le=1 << 20)
    """The share of `memory_mb` for the sandbox's in-memory dirs (`/tmp`, `/dev/shm`, `/run`,
    together); None = a quarter of `memory_mb`."""
    disk_mb: int = Field(default=1024, ge=1, le=1 << 30)
    """Total bytes a task may hold in its working dir (checked while it runs)."""
    disk_files: int = Field(default=100_000, ge=16, le=10_000_000)
    """Files and dirs a task may hold in its working dir."""
    processes: int = Field(default=512, ge=1, le=1 << 16)
    """RLIMIT_NPROC: counted per user by the kernel, so it caps fork bombs, not exact counts."""
    file_size_mb: int = Field(default=256, ge=1, le=1 << 20)
    max_timeout_s: int = Field(default=600, ge=1, le=86400)
    """A task's `timeout_s` is capped at this."""

    @field_validator("ro_binds", "rw_binds")
    @classmethod
    def _binds_absolute(cls, paths: list[str]) -> list[str]:
        return _absolute(paths)

    @model_validator(mode="after")
    def _tmpfs_within_memory(self) -> CommandPolicy:
        if self.tmpfs_mb is not None and self.memory_mb - self.tmpfs_mb < 12:
            raise ValueError(
                f"tmpfs_mb = {self.tmpfs_mb} leaves less than 12 MiB of memory_mb = "
                f"{self.memory_mb} for the task's processes: lower tmpfs_mb or raise memory_mb"
            )
        return self

    @property
    def tmpfs_total_mb(self) -> int:
        """The in-memory dirs' share of `memory_mb` (see `tmpfs_mb`)."""
        return self.tmpfs_mb if self.tmpfs_mb is not None else max(4, self.memory_mb // 4)


WORKSPACE_HIDE = (".env*", "*.pem", "*.key", "id_*")


class WorkspacePolicy(_Strict):
    """Which directories a run may name as its workspace, and what of them tasks may see.

    `roots` (with `tally serve --workspace-root`) are the directories a workspace must lie
    inside; none by default, so no run can read a project until the operator allows one.
    Files matching `hide` (by name or relative path, shell patterns) are never copied into a
    task's view; `max_files` and `max_bytes` bound a snapshot."""

    roots: list[str] = Field(default=[], max_length=256)
    hide: list[str] = Field(default=list(WORKSPACE_HIDE), max_length=256)
    max_files: Annotated[int, Field(ge=1, le=1_000_000), Whole] = 5000
    max_bytes: Annotated[int, Field(ge=1, le=1 << 40), Whole] = 64 * 1024 * 1024

    @field_validator("roots")
    @classmethod
    def _roots_absolute(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.startswith("/") or "\x00" in path:
                raise ValueError(f"{path!r}: a workspace root must be an absolute path")
        return paths


class Policy(_Strict):
    max_parallel: Annotated[int, Field(ge=1, le=1024), Whole] = 4
    max_runs: Annotated[int, Field(ge=1, le=65_536), Whole] = 64
    max_queued_runs: Annotated[int, Field(ge=0, le=65_536), Whole] = 256
    """Runs admitted beyond `max_runs`, waiting (state `queued`) for one to finish; past this,
    submit answers busy (HTTP 503 with Retry-After) and nothing is witnessed."""
    threshold: float = Field(default=0.35, ge=0, le=1)
    margin: float = Field(default=0.1, ge=0, le=1)
    budget: Budget = Budget(model_calls=64, tokens=200_000, wall_s=600)
    on_task_failure: Literal["fail", "continue"] = "fail"
    coordinator: str | None = None
    """Tier or member that plans a request the client gave no plan for; None = one task."""
    judge: str | None = None
    """Tier or member that judges chat output once its assertions pass; None = no judge."""
    classifier: str | None = None
    """Tier or member that picks the lane when keyword routing is unsure, among the few best
    scoring lanes (and `general`). None = no model call for routing: the best-scoring lane,
    or the `general` lane when no lane's words match."""
    embeddings: str | None = None
    """Member (or tier) serving OpenAI-compatible `/v1/embeddings`: lanes are also scored by
    the likeness of a request to their examples (daemon.embeddings). None = keywords only."""
    command: CommandPolicy = CommandPolicy()
    workspace: WorkspacePolicy = WorkspacePolicy()
    attempts_per_rung: Annotated[int, Field(ge=1, le=16), Whole] = 2
    """Attempts on one rung of the ladder, each with the last one's failures as feedback,
    before the task climbs to the next rung."""
    keep_runs: Annotated[int, Field(ge=1, le=10_000), Whole] = 256
    """Finished runs kept in full in memory; older ones keep a summary."""
    keep_summaries: Annotated[int, Field(ge=0, le=200_000), Whole] = 20_000
    """Summaries kept beyond `keep_runs` (about 1 KB each: the cap bounds them to ~200 MB);
    older runs are read back from the ledger on demand."""


class Gateway(_Strict):
    """The OpenAI-compatible endpoint (`/v1/chat/completions`, `/v1/models`) over the pool."""

    enabled: bool = True
    bodies: Literal["store", "hashes"] = "store"
    """"store": request and response bodies go into the ledger's body store (redactable);
    "hashes": only their SHA-256 and sizes, for an audit trail without the content."""
    queue_timeout_s: float = Field(default=60.0, gt=0, le=DAY_S)
    """A call waiting this long for a slot gets 504."""
    max_waiting: Annotated[int, Field(ge=0, le=65_536), Whole] = 64
    """Gateway calls that may wait for a slot at once; one more gets 429 with Retry-After, so
    gateway traffic cannot fill the queues the runs use."""
    retries: Annotated[int, Field(ge=0, le=8), Whole] = 1
    """Failed attempts retried (on a `lane:` model, one tier up) while no token was sent."""
    affinity: bool = True
    """Keep a conversation on the slot that holds its KV cache (see daemon.gateway)."""
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20), Whole] = 4096
    """The most a call may ask for (`max_tokens`), and what it gets if it does not say."""
    fallbacks: dict[
        Annotated[str, Field(min_length=1, max_length=200)],
        Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=16)],
    ] = Field(default={}, max_length=1024)
    """A model id (a member, `tier:NAME` or `lane:NAME`) -> the model ids tried in order when
    it cannot serve (down, busy, timed out, a server error) before any byte reached the client
    (LiteLLM's `fallbacks`). Each switch is witnessed as `gateway.fallback`."""


class Roster(_Strict):
    version: Literal[1] = 1
    policy: Policy = Policy()
    gateway: Gateway = Gateway()
    models: list[Member] = Field(min_length=1)
    tiers: Tiers
    lanes: list[Lane] = Field(min_length=1)

    def lane(self, name: str) -> Lane | None:
        return next((lane for lane in self.lanes if lane.name == name), None)

    def member(self, name: str) -> Member | None:
        return next((m for m in self.models if m.name == name), None)


_PKG = re.compile(r"^pkg:(?P<package>[A-Za-z_][A-Za-z0-9_.]*)/(?P<file>.+)$")


def resolve_model_path(ref: str, *, base: Path | None = None) -> Path:
    """Resolve a member's `model` reference: a path, `~/…`, or `pkg:<package>/<file>`.

    `pkg:` references are found through importlib's spec without importing the package
    (the SmolLM2 wheel's package would import `llm`, which is deliberately not installed).
    Raises FileNotFoundError with the reference when the file is not there.
    """
    match = _PKG.match(ref)
    if match:
        spec = importlib.util.find_spec(match["package"])
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{ref}: package {match['package']!r} is not installed")
        path = Path(next(iter(spec.submodule_search_locations))) / match["file"]
    else:
        path = Path(ref).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
    if not path.is_file():
        raise FileNotFoundError(f"{ref}: no model file at {path}")
    return path
