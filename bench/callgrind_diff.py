"""Where two gateways' instructions per request differ, function by function (C level).

``bench.instructions --keep`` leaves each side's callgrind dumps; this takes one dump of each
side and prints, per request, the functions whose own (exclusive) instruction counts differ
most. Python code shows as the interpreter's loop and what it calls (dict lookups, frames,
allocation), so a Python-level step appears by its C marks: a statement prepared again and
again, a frozen dataclass's ``object.__setattr__``, a regular expression, a collection.

    .venv/bin/python -m bench.callgrind_diff A_DUMP B_DUMP --requests 300 [--top 40]

Needs valgrind's ``callgrind_annotate`` (Debian package valgrind).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from collections import Counter
from pathlib import Path

_ROW = re.compile(r"^\s*([\d,]+) \([^)]*\)\s+(.*)$")
# CPython's build directory differs between builds; the function's own name is what matters.
_BUILD_DIR = re.compile(r"^/tmp/python-build[^/]*/Python-[\d.]+/")
_OBJECT_FILE = re.compile(r" \[[^\]]*\]$")


def exclusive_counts(dump: Path) -> Counter[str]:
    """Instructions executed in each function itself, from ``callgrind_annotate``."""
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(dump)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts: Counter[str] = Counter()
    for line in out.splitlines():
        match = _ROW.match(line)
        if match is None or "PROGRAM TOTALS" in line:
            continue
        name = _OBJECT_FILE.sub("", _BUILD_DIR.sub("", match.group(2)))
        counts[name] += int(match.group(1).replace(",", ""))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--requests", type=int, required=True, help="requests in each dump")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    a, b = exclusive_counts(args.a), exclusive_counts(args.b)
    n = args.requests
    print(f"per request: A {a.total() / n / 1e3:.0f} k, B {b.total() / n / 1e3:.0f} k instructions")
    print(f"{'A - B':>9} {'A':>9} {'B':>9}  function")
    differences = {name: a[name] - b[name] for name in a.keys() | b.keys()}
    for name, difference in sorted(differences.items(), key=lambda item: -abs(item[1]))[: args.top]:
        print(f"{difference / n:+9.0f} {a[name] / n:9.0f} {b[name] / n:9.0f}  {name[:140]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
