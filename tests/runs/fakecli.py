"""A scripted coding-agent CLI for the agent-cli tests: a real executable, run in the real
sandbox on a real view. `write(dir)` puts it there; argv[1] is what it does:

- `fix`: reads its prompt on stdin; writes a wrong `add` into calc.py, or the right one once
  the prompt carries a failed check; prints what it did and the value of `FAKE_KEY`;
- `echo FILE|TEXT`: prints the prompt from the file (prompt = "file") or the argument
  (prompt = "arg"), and its working dir's listing;
- `hang`: starts a grandchild in a new session (`sleep 987.654`), then sleeps;
- `flood`: writes 24 MiB to stdout, then exits 0;
- `fail`: prints to stderr and exits 3;
- `escape STATE OUTSIDE`: tries to write outside its view, read the state dir and reach the
  network (`PORT`), and prints what happened to each;
- `span`: sleeps 0.6 s and prints when it started and ended (CLOCK_MONOTONIC is the host's);
- `nothing`: answers and changes nothing;
- `--version`: prints its version.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

SCRIPT = r"""
import os, socket, subprocess, sys, time

WRONG = "def add(a, b):\n    return a * b\n"
RIGHT = "def add(a, b):\n    return a + b\n"


def attempt(what, action):
    try:
        action()
        print(f"{what}: ALLOWED")
    except OSError as exc:
        print(f"{what}: refused ({type(exc).__name__})")


mode = sys.argv[1]
if mode == "--version":
    print("fakecli 1.2.3")
elif mode == "fix":
    prompt = sys.stdin.read()
    fixed = "failed these checks" in prompt or "failed" in prompt.lower()
    with open("calc.py", "w") as f:
        f.write(RIGHT if fixed else WRONG)
    print(f"edited calc.py ({'right' if fixed else 'wrong'}); key {os.environ.get('FAKE_KEY')}")
    print(f"home {os.environ.get('HOME')}")
elif mode == "echo":
    print(open(sys.argv[2]).read() if os.path.isfile(sys.argv[2]) else sys.argv[2])
    print("listing", sorted(os.listdir(".")))
elif mode == "hang":
    subprocess.Popen(["sleep", "987.654"], start_new_session=True)
    print("started", flush=True)
    time.sleep(1000)
elif mode == "flood":
    chunk = b"x" * 65536
    for _ in range(384):
        sys.stdout.buffer.write(chunk)
    sys.stdout.flush()
elif mode == "fail":
    print("boom: the agent could not finish", file=sys.stderr)
    sys.exit(3)
elif mode == "escape":
    state, outside, port = sys.argv[2], sys.argv[3], int(sys.argv[4])
    attempt("write outside", lambda: open(outside, "w").write("escaped"))
    attempt("write /etc", lambda: open("/etc/tally-escaped", "w").write("escaped"))
    attempt("write own binary", lambda: open(__file__, "a").write("# escaped"))
    attempt("list state", lambda: os.listdir(state))
    attempt("network", lambda: socket.create_connection(("127.0.0.1", port), timeout=2))
    attempt("write view", lambda: open("inside.txt", "w").write("fine"))
elif mode == "span":
    start = time.monotonic()
    time.sleep(0.6)
    print(f"span {start} {time.monotonic()}")
elif mode == "nothing":
    sys.stdin.read()
    print("nothing to change here")
else:
    sys.exit(f"unknown mode {mode}")
"""


def write(directory: Path) -> Path:
    """The fake CLI as an executable file in `directory` (bind that dir into the sandbox)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fakecli"
    path.write_text(f"#!{sys.executable}\n{SCRIPT}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def leftovers(marker: str) -> list[int]:
    """Pids of live processes whose command line holds `marker`."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        if marker.encode() in cmdline and "State:\tZ" not in status:
            found.append(int(entry))
    return found
