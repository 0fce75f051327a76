"""Run llama.cpp's server from the `xllamacpp` wheel with `llama-server`-compatible flags.

    python -m daemon.slots.launcher --model M --host 127.0.0.1 --port P \
        --parallel N --ctx-size C --threads T

xllamacpp has no command line of its own: `xllamacpp.Server(params)` serves HTTP from threads
inside this process. The launcher turns it into a standalone server process with the slots,
metrics and props endpoints on, offline and without the web UI. It exits cleanly on SIGTERM
or SIGINT, and also when its parent dies (so a SIGKILLed daemon leaves no server behind).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent-pid poll below still guards


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m daemon.slots.launcher")
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("-np", "--parallel", type=int, default=1)
    parser.add_argument("-c", "--ctx-size", type=int, default=4096)
    parser.add_argument("-t", "--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--alias", default=None)
    parser.add_argument("--chat-template-file", default=None)
    return parser.parse_args(argv)


def build_params(args: argparse.Namespace) -> Any:
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_size  # like llama-server: the total, split across the slots
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.endpoint_slots = True
    params.endpoint_metrics = True
    params.endpoint_props = True
    params.offline = True
    params.ui = False
    if args.alias:
        params.model_alias = {args.alias}
    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            params.chat_template = f.read()
    return params


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    parent = os.getppid()
    die_with_parent()
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    import xllamacpp

    server = xllamacpp.Server(build_params(args))
    print(f"listening {server.listening_address}", flush=True)
    # The poll guards the case where PR_SET_PDEATHSIG is unavailable or raced with fork.
    while not stop.wait(0.5):
        if os.getppid() != parent:
            break
    del server
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
