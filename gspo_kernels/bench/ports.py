"""A free TCP port for a process group's rendezvous on this machine (MASTER_PORT)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on at the time of the call: the OS picks it (bind
    to port 0). Another process may take it before the group binds it, as with any such pick."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
