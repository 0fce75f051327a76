"""The surfaces' fixtures: the real Daemon over a fake model server, served on a unix socket."""

from tests.surfaces.conftest import daemon, model, unix_server

__all__ = ["daemon", "model", "unix_server"]
