"""A real PostgreSQL server for the tests and the benchmark: `initdb` in a temporary dir, `pg_ctl`
start with a unix socket only (no TCP), `synchronous_commit = on`, `fsync = on`.

`initdb` refuses to run as root: as root the server runs as the `postgres` user (its data
dir owned by it); otherwise as the current user. The binaries are found on PATH or in
Debian's /usr/lib/postgresql/*/bin (the `postgresql` package, which `make install` installs).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def binaries() -> Path | None:
    """The directory holding initdb and pg_ctl (the newest Debian version), or None."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[4]) if Path(p).parts[4].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).resolve().parent if on_path else None


class Server:
    """One server; `dsn(db)` names a database on it (made by `create`)."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="tally-pg-"))
        self.data = self.root / "data"
        self.socket = self.root / "sock"
        self.as_root = os.geteuid() == 0
        self.user = "postgres" if self.as_root else None
        self.socket.mkdir()
        if self.as_root:
            os.chmod(self.root, 0o755)
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(self.socket, "postgres", "postgres")

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / args[0]), *args[1:]]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(
            command, check=check, capture_output=True, text=True, timeout=60, cwd="/"
        )

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "tally", "--no-sync")
        conf = self.data / "postgresql.conf"
        with open(conf, "a") as f:
            f.write(
                "listen_addresses = ''\n"
                f"unix_socket_directories = '{self.socket}'\n"
                "synchronous_commit = on\n"
                "fsync = on\n"
                "max_connections = 60\n"
                "shared_buffers = 16MB\n"
            )

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "30", "-l", str(self.log), "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "30", "-m", mode, "stop", check=False)

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def dsn(self, db: str = "postgres") -> str:
        return f"postgresql://tally@/{db}?host={self.socket}"

    def create(self, db: str) -> str:
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{db}"')
        return self.dsn(db)

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def started() -> Server | None:
    bindir = binaries()
    if bindir is None:
        return None
    server = Server(bindir)
    server.init()
    server.start()
    return server
