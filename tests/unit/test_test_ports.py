"""The suites' fixed ports stay clear of the ports the kernel gives outgoing connections."""

from __future__ import annotations

import re
from pathlib import Path

from tests.ports import ephemeral_range

TESTS = Path(__file__).resolve().parents[1]
# `worker_share(31100, 31150)` and `..._PORT = 30120` / `port=32200` style constants.
_RANGE = re.compile(r"worker_share\((\d+), (\d+)\)")
_FIXED = re.compile(r"(?:_PORT\b[^=\n]*=|_port=|bootstrap_port: int =)\s*([\d, ]+)")


def _fixed_ports() -> dict[int, str]:
    found: dict[int, str] = {}
    for path in TESTS.rglob("*.py"):
        text = path.read_text()
        for match in _RANGE.finditer(text):
            for port in range(int(match[1]), int(match[2])):
                found[port] = str(path.relative_to(TESTS))
        for match in _FIXED.finditer(text):
            for value in re.findall(r"\d{4,5}", match[1]):
                found[int(value)] = str(path.relative_to(TESTS))
    return found


def test_the_scan_finds_the_suites_port_ranges() -> None:
    found = _fixed_ports()
    assert {31100, 31249, 31399, 32000, 30120}.issubset(found)


def test_no_suite_binds_a_fixed_port_inside_the_ephemeral_range() -> None:
    ephemeral = ephemeral_range()
    inside = {port: path for port, path in _fixed_ports().items() if port in ephemeral}
    assert not inside, f"fixed ports inside the ephemeral range {ephemeral}: {inside}"
