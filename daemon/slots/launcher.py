"""Run llama.cpp's server from the `xllamacpp` wheel with `llama-server`-compatible flags.

    python -m daemon.slots.launcher --model M --host 127.0.0.1 --port P \
        --parallel N --ctx-size C --threads T

xllamacpp has no command line of its own: `xllamacpp.Server(params)` serves HTTP from threads
inside this process. The launcher turns it into a standalone server process with the slots,
metrics and props endpoints on, offline and without the web UI.

It never outlives its parent, and never hangs on a signal:
- The parent-death signal is SIGKILL (the pool sets it between fork and exec; the launcher
  sets the same when run by hand): the kernel ends it when the daemon dies, however the daemon
  died and whatever the launcher is doing, start-up included. An earlier version replaced it
  with SIGTERM, which a main thread blocked in the model load or the server's teardown never
  got to handle: about one launcher in ten outlived a SIGKILLed daemon, holding its port.
- SIGTERM/SIGINT during start-up (model load, server threads starting) keep their default
  action: the process ends at once, there is nothing to clean up yet. Once it serves, they ask
  for a clean stop, bounded by a C-level watchdog (faulthandler) that `_exit`s if the teardown
  hangs, GIL or not.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1


STOP_GRACE_S = 10.0
"""How long a clean stop may take before the watchdog ends the process."""


def die_with_parent(sig: int = signal.SIGKILL) -> None:
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
    parser.add_argument(
        "--embeddings", action="store_true", help="serve /v1/embeddings (as llama-server does)"
    )
    parser.add_argument(
        "--pooling",
        choices=["none", "mean", "cls", "last", "rank"],
        default=None,
        help="how token embeddings become one (llama-server's --pooling; /v1/embeddings "
        "needs one other than none, and a chat model has none by default)",
    )
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
    if args.embeddings:
        params.embedding = True
    if args.pooling:
        params.pooling_type = getattr(
            xllamacpp.llama_pooling_type, f"LLAMA_POOLING_TYPE_{args.pooling.upper()}"
        )
    if args.alias:
        params.model_alias = {args.alias}
    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            params.chat_template = f.read()
    return params


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    die_with_parent()  # the pool's spawn guard already checked the parent is still there
    parent = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)  # during start-up: end at once

    import xllamacpp

    server = xllamacpp.Server(build_params(args))
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    print(f"listening {server.listening_address}", flush=True)
    # The poll guards systems without PR_SET_PDEATHSIG.
    while not stop.wait(0.5):
        if os.getppid() != parent:
            break
    faulthandler.dump_traceback_later(STOP_GRACE_S, exit=True)
    del server
    faulthandler.cancel_dump_traceback_later()
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
