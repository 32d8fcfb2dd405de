"""Which TCP connections a process holds, from /proc: for leak checks on the gateway's upstream
pool."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

# /proc/net/tcp state codes
TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def upstream_sockets(pid: int, remote_ports: set[int]) -> Counter[str]:
    """The process's TCP sockets to any of ``remote_ports`` on loopback, counted by state."""
    return _sockets(pid, lambda local, remote: remote in remote_ports)


def accepted_sockets(pid: int, local_port: int) -> Counter[str]:
    """The process's TCP connections accepted on ``local_port`` (its listener left out),
    counted by state."""
    return _sockets(pid, lambda local, remote: local == local_port and remote != 0)


def _sockets(pid: int, wanted: Callable[[int, int], bool]) -> Counter[str]:
    """The process's loopback TCP sockets whose (local port, remote port) are ``wanted``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        match = re.fullmatch(r"socket:\[(\d+)\]", target)
        if match:
            inodes.add(match.group(1))
    held: Counter[str] = Counter()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        remote_port = int(fields[2].split(":")[1], 16)
        if fields[9] in inodes and wanted(local_port, remote_port):
            held[TCP_STATES.get(fields[3], fields[3])] += 1
    return held
