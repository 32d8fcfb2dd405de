"""`isogate check-pools` passes on a safe deployment and fails on an unreachable worker."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.dev.harness import free_port
from tests.harness import REPO_ROOT

pytestmark = pytest.mark.engine


def check_pools(*workers: str) -> subprocess.CompletedProcess[str]:
    args = [arg for worker in workers for arg in ("--worker", worker)]
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-pools", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_pools_passes_on_a_safe_cluster(pd_cluster) -> None:
    result = check_pools(f"prefill={pd_cluster.prefill_url}", f"decode={pd_cluster.decode_url}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" ok") == 2
    assert "kv_pool_tokens" in result.stdout.splitlines()[0]


def test_check_pools_fails_on_an_unreachable_worker(pd_cluster) -> None:
    result = check_pools(
        f"prefill={pd_cluster.prefill_url}", f"decode=http://127.0.0.1:{free_port()}"
    )
    assert result.returncode == 1
    assert "unreachable" in result.stdout
