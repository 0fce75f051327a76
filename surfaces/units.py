"""The systemd units, generated here so `tally unit` can fill in the absolute ExecStart path.

systemd/tallyd.service and systemd/tallyd-system.service are these texts with the placeholder
path; a test keeps the files and the generator identical.
"""

from __future__ import annotations

import shlex

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
ExecStart={exec_start} serve --state ${{STATE_DIRECTORY}} --socket ${{RUNTIME_DIRECTORY}}/tally.sock
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
ExecStart={exec_start} serve --state ${{STATE_DIRECTORY}} --socket ${{RUNTIME_DIRECTORY}}/tally.sock
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
ProtectHome=yes
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
SystemCallFilter=~@privileged @resources
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


def user_unit(exec_start: str = PLACEHOLDER) -> str:
    return _USER.format(exec_start=shlex.quote(exec_start))


def system_unit(exec_start: str = PLACEHOLDER) -> str:
    return _SYSTEM.format(exec_start=shlex.quote(exec_start))
