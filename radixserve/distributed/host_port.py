"""The one parser of a `host:port` address (--dist-init-addr): ServerArgs validates with it, the ranks and
the node monitors connect with it. No torch here: ServerArgs imports it."""

from __future__ import annotations


def parse_host_port(addr: str) -> tuple[str, int]:
    """'host:port' or '[v6addr]:port' -> (host, port); ValueError naming what is wrong."""
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"must be host:port with a port in [1, 65535], got {addr!r}")
    return host, int(port)
