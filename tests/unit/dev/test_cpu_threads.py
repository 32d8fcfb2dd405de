"""The pair's two CPU workers split the cores instead of each running a thread on every one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.dev.cluster import PDCluster, cpu_threads_env, default_cluster_spec


def test_each_worker_gets_half_of_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_threads_env() == {"OMP_NUM_THREADS": "2"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert cpu_threads_env() == {"OMP_NUM_THREADS": "1"}


def test_a_thread_count_set_by_the_operator_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_env() == {}


def test_both_workers_are_started_with_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    cluster = PDCluster(default_cluster_spec(prefill_port=1, decode_port=2, log_dir=tmp_path))
    assert cluster.prefill.env["OMP_NUM_THREADS"] == "1"
    assert cluster.decode.env["OMP_NUM_THREADS"] == "1"
