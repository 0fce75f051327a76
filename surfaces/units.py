"""The systemd units, generated here so `tally unit` can fill in the absolute ExecStart path.

systemd/tallyd.service and systemd/tallyd-system.service are these texts with the placeholder
path; a test keeps the files and the generator identical.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

PLACEHOLDER = "/usr/local/bin/tally"

_USER = """\
# tally daemon as a systemd USER unit: `tally unit --install`, then
#   systemctl --user daemon-reload && systemctl --user enable --now tallyd
# (`loginctl enable-linger $USER` keeps it running without a login session).
[Unit]
Description=tally: local agent fleets with a verifiable ledger

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
Restart=on-failure
RestartSec=2s
TimeoutStartSec=120s
TimeoutStopSec=30s
WatchdogSec=30s
StateDirectory=tally
StateDirectoryMode=0700
RuntimeDirectory=tally
RuntimeDirectoryMode=0700
UMask=0077
NoNewPrivileges=yes
LockPersonality=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
# bubblewrap (the command-task sandbox) creates user, mount, PID, network, IPC, UTS and cgroup
# namespaces and mounts inside them: allow those, nothing else (no time namespaces).
RestrictNamespaces=user mnt pid net ipc uts cgroup
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
SystemCallArchitectures=native
SystemCallFilter=@system-service @mount
SystemCallErrorNumber=EPERM
# Descriptors: TCP connections stop well below this (see the README's security section),
# so the socket, the ledger and the sandbox keep theirs.
LimitNOFILE=65536
Environment=PYTHONUNBUFFERED=1
# The checkpoint signing key, kept out of the state dir: put it at the path below (0600) and
# systemd hands it to the daemon alone in $CREDENTIALS_DIRECTORY. Without that file the
# SetCredential= default ("unset") applies and the daemon uses the state dir's key.
LoadCredential=tally-checkpoint.key:%E/tally/checkpoint.key
SetCredential=tally-checkpoint.key:unset

[Install]
WantedBy=default.target
"""

_SYSTEM = """\
# tally daemon as a SYSTEM unit with the full hardening set (shared host service).
# Install: copy to /etc/systemd/system/tallyd.service, then systemctl enable --now tallyd.
# Clients of the socket need to run as the service user (or use --tcp with the token).
[Unit]
Description=tally: local agent fleets with a verifiable ledger
After=network.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
Restart=on-failure
RestartSec=2s
TimeoutStartSec=120s
TimeoutStopSec=30s
WatchdogSec=30s
DynamicUser=yes
StateDirectory=tally
StateDirectoryMode=0700
RuntimeDirectory=tally
RuntimeDirectoryMode=0750
UMask=0077
NoNewPrivileges=yes
ProtectSystem=strict
{read_write}ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
PrivateIPC=yes
ProtectHostname=yes
ProtectClock=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectProc=invisible
ProcSubset=pid
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
# bubblewrap (the command-task sandbox) creates user, mount, PID, network, IPC, UTS and cgroup
# namespaces and mounts inside them: allow those, nothing else (no time namespaces).
RestrictNamespaces=user mnt pid net ipc uts cgroup
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
RemoveIPC=yes
SystemCallArchitectures=native
SystemCallFilter=@system-service
# @resources is not denied: command tasks run under nice(1), whose setpriority is in that set
# (`systemd-analyze syscall-filter @resources`). Denied, nice gets EPERM and runs every task
# un-niced with "nice: cannot set niceness" in its output. (prlimit64, for the tasks' rlimits,
# is in @default.) tests/surfaces/test_systemd.py checks both against systemd-analyze.
SystemCallFilter=~@privileged
SystemCallFilter=@mount
SystemCallErrorNumber=EPERM
CapabilityBoundingSet=
AmbientCapabilities=
DevicePolicy=closed
IPAddressDeny=any
IPAddressAllow=localhost
# Descriptors: TCP connections stop well below this (see the README's security section),
# so the socket, the ledger and the sandbox keep theirs.
LimitNOFILE=65536
Environment=PYTHONUNBUFFERED=1
# The checkpoint signing key, kept out of the state dir: put it at the path below (0600) and
# systemd hands it to the daemon alone in $CREDENTIALS_DIRECTORY. Without that file the
# SetCredential= default ("unset") applies and the daemon uses the state dir's key.
LoadCredential=tally-checkpoint.key:%E/tally/checkpoint.key
SetCredential=tally-checkpoint.key:unset

[Install]
WantedBy=multi-user.target
"""


DEFAULT_STATE = "${STATE_DIRECTORY}"
DEFAULT_SOCKET = "${RUNTIME_DIRECTORY}/tally.sock"


def quote(word: str) -> str:
    """One ExecStart word, as systemd reads it back: `%` is a specifier and `$` a variable
    unless doubled, a backslash and a double quote are escaped inside double quotes, and a
    word with a space (or nothing) is double-quoted. Control characters cannot be said."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in word):
        raise ValueError(f"{word!r} holds a control character: a unit cannot carry it")
    text = word.replace("%", "%%").replace("$", "$$")
    if word and not any(c in word for c in " \t\"'\\;"):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_start(
    exe: str, options: Sequence[str] = (), state: str | None = None, socket: str | None = None
) -> str:
    """`EXE serve --state … --socket … OPTIONS`: systemd's directories unless given."""
    words = [quote(exe), "serve"]
    words += ["--state", DEFAULT_STATE if state is None else quote(state)]
    words += ["--socket", DEFAULT_SOCKET if socket is None else quote(socket)]
    return " ".join(words + [quote(o) for o in options])


def user_unit(
    exe: str = PLACEHOLDER,
    options: Sequence[str] = (),
    state: str | None = None,
    socket: str | None = None,
) -> str:
    return _USER.format(exec_start=exec_start(exe, options, state, socket))


def system_unit(
    exe: str = PLACEHOLDER,
    options: Sequence[str] = (),
    state: str | None = None,
    socket: str | None = None,
    workspace_roots: Sequence[str] = (),
) -> str:
    # ProtectSystem=strict leaves only the unit's own directories writable: a state dir or a
    # socket elsewhere must be named, and so must each workspace root (`tally apply` writes
    # there from the daemon).
    writable = [p for p in (state, None if socket is None else str(Path(socket).parent)) if p]
    writable += [p for p in workspace_roots if p not in writable]
    read_write = f"ReadWritePaths={' '.join(quote(p) for p in writable)}\n" if writable else ""
    return _SYSTEM.format(exec_start=exec_start(exe, options, state, socket), read_write=read_write)


HIDDEN_BY_SYSTEM_UNIT: tuple[tuple[str, str], ...] = (
    ("/tmp", "PrivateTmp=yes gives the service its own empty /tmp"),
    ("/var/tmp", "PrivateTmp=yes gives the service its own empty /var/tmp"),
    ("/home", "ProtectHome=yes hides /home"),
    ("/root", "ProtectHome=yes hides /root"),
    ("/run/user", "ProtectHome=yes hides /run/user"),
)


def hidden(path: str) -> str | None:
    """Why the system unit's sandbox hides `path` from the daemon (None: it does not)."""
    for root, why in HIDDEN_BY_SYSTEM_UNIT:
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return why
    return None


def installed() -> str | None:
    """How to start the installed unit (`systemctl …`), or None when no unit is installed."""
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    if (config / "systemd" / "user" / "tallyd.service").is_file():
        return "systemctl --user start tallyd"
    for base in ("/etc/systemd/system", "/usr/local/lib/systemd/system", "/lib/systemd/system"):
        if (Path(base) / "tallyd.service").is_file():
            return "sudo systemctl start tallyd"
    return None
