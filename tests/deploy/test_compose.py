"""compose.yaml describes a deployment that can start: every check Docker would make at
``config`` time that this machine can make without Docker, and the isogate-specific wiring
(start-up order, health checks, GPU reservations, Mooncake, settings the gateway knows)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from engine_patch.settings import CLAMP_CONTEXT_ENV, DISABLE_CHECKS_ENV, REQUIRE_TAGS_ENV
from gateway.config.policies import load_policies
from gateway.config.settings import Settings
from tests.deploy.compose_spec import (
    COMPOSE_FILE,
    ENV_EXAMPLE,
    MissingVariable,
    depends_on,
    environment_of,
    interpolate,
    load_compose,
    read_env_file,
)
from tests.harness import REPO_ROOT

ENGINE_ENTRYPOINT = REPO_ROOT / "docker" / "engine-entrypoint.sh"


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose(read_env_file(ENV_EXAMPLE))


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def _built_from(service: dict, dockerfile: str) -> bool:
    return (service.get("build") or {}).get("dockerfile") == dockerfile


def _gateway_replicas(services: dict) -> dict:
    return {
        name: s
        for name, s in services.items()
        if _built_from(s, "docker/gateway.Dockerfile") and s.get("command") in (None, ["serve"])
    }


def _engines(services: dict) -> dict:
    return {name: s for name, s in services.items() if _built_from(s, "docker/engine.Dockerfile")}


def test_the_deployment_has_every_part(services: dict) -> None:
    assert len(_gateway_replicas(services)) == 2
    assert {
        environment_of(s)["SGLANG_DISAGGREGATION_MODE"] for s in _engines(services).values()
    } == {"prefill", "decode"}
    images = {name: s.get("image", "") for name, s in services.items()}
    assert images["postgres"].startswith("postgres:") and images["redis"].startswith("redis:")
    assert services["migrate"]["command"] == ["migrate"] and services["migrate"]["restart"] == "no"
    assert services["pool-gate"]["command"] == ["check-pools"]


def test_required_secrets_have_no_defaults() -> None:
    env = read_env_file(ENV_EXAMPLE)
    for secret in ("POSTGRES_PASSWORD", "ISOGATE_ADMIN_KEY", "ISOGATE_CACHE_SALT_SECRET"):
        without = {key: value for key, value in env.items() if key != secret}
        with pytest.raises(MissingVariable, match=secret):
            load_compose(without)


def test_images_and_build_contexts_exist(services: dict) -> None:
    for name, service in services.items():
        build = service.get("build")
        if build:
            context = REPO_ROOT / build.get("context", ".")
            assert context.is_dir(), name
            assert (context / build["dockerfile"]).is_file(), (
                f"{name}: {build['dockerfile']} missing"
            )
        else:
            image = service["image"]
            assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", image), (
                f"{name}: image {image!r} is not pinned to a version"
            )


def test_bind_mounts_point_at_files_in_the_repository(services: dict) -> None:
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./docker/") or source.startswith("./deploy/"):
                assert (REPO_ROOT / source).exists(), f"{name}: {source} does not exist"


def test_start_up_order_conditions_can_be_met(compose: dict, services: dict) -> None:
    for name, service in services.items():
        for dependency, condition in depends_on(service).items():
            assert dependency in services, f"{name} depends on unknown service {dependency}"
            target = services[dependency]
            if condition == "service_healthy":
                healthcheck = target.get("healthcheck") or {}
                image_has_one = _built_from(target, "docker/gateway.Dockerfile") or _built_from(
                    target, "docker/engine.Dockerfile"
                )
                assert healthcheck.get("test") or image_has_one, (
                    f"{name} waits for {dependency}'s health"
                )
            elif condition == "service_completed_successfully":
                assert target.get("restart") == "no", (
                    f"{dependency} is one-shot, it must not restart"
                )
            else:
                assert condition == "service_started", condition
    for replica in _gateway_replicas(services).values():
        assert depends_on(replica)["migrate"] == "service_completed_successfully"
        assert depends_on(replica)["pool-gate"] == "service_completed_successfully"
    assert depends_on(services["migrate"]) == {"postgres": "service_healthy"}
    assert set(depends_on(services["pool-gate"]).values()) == {"service_healthy"}
    assert set(depends_on(services["pool-gate"])) == set(_engines(services))
    _assert_acyclic(services)


def _assert_acyclic(services: dict) -> None:
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert state.get(name) != "open", f"depends_on cycle: {' -> '.join((*path, name))}"
        if state.get(name) == "done":
            return
        state[name] = "open"
        for dependency in depends_on(services[name]):
            visit(dependency, (*path, name))
        state[name] = "done"

    for name in services:
        visit(name, ())


def test_health_checks_probe_readyz_and_sglang_health(services: dict) -> None:
    for name, replica in _gateway_replicas(services).items():
        assert "/readyz" in " ".join(replica["healthcheck"]["test"]), name
    for name, engine in _engines(services).items():
        test = " ".join(engine["healthcheck"]["test"])
        assert f"127.0.0.1:{environment_of(engine)['SGLANG_PORT']}/health" in test, name
        assert engine["healthcheck"]["start_period"], "model loading needs a start period"


def test_engines_reserve_nvidia_gpus_and_use_mooncake(services: dict) -> None:
    entrypoint = ENGINE_ENTRYPOINT.read_text()
    assert "--disaggregation-transfer-backend mooncake" in entrypoint
    for name, engine in _engines(services).items():
        devices = engine["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(
            d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices
        ), name
        env = environment_of(engine)
        assert env["MOONCAKE_PROTOCOL"] in ("tcp", "rdma"), name
        # Every SGLANG_* variable set here is one the entry point reads (a typo would be ignored).
        for key in env:
            if key.startswith("SGLANG_"):
                assert "${" + key in entrypoint, (
                    f"{name}: {key} is not read by docker/engine-entrypoint.sh"
                )
            if key.startswith("ISOGATE_ENGINE_"):
                assert key in (CLAMP_CONTEXT_ENV, REQUIRE_TAGS_ENV, DISABLE_CHECKS_ENV), (
                    f"{name}: unknown {key}"
                )
        assert DISABLE_CHECKS_ENV not in env, "a deployment never switches engine checks off"
    prefill = services["sglang-prefill"]
    assert environment_of(prefill)["SGLANG_BOOTSTRAP_PORT"]


def test_gateway_environment_names_only_settings_the_gateway_knows(services: dict) -> None:
    known = {"ISOGATE_" + name.upper() for name in Settings.model_fields}
    policy_text = "".join(p.read_text() for p in (REPO_ROOT / "deploy" / "policies").glob("*.yaml"))
    for name, service in services.items():
        if not _built_from(service, "docker/gateway.Dockerfile"):
            continue
        for key in environment_of(service):
            if key.startswith("ISOGATE_"):
                assert key in known, (
                    f"{name}: {key} is not a gateway setting (typo? it would be ignored)"
                )
            elif key.startswith("POLICY_"):
                assert "${" + key in policy_text, f"{name}: {key} is not used by deploy/policies"
            else:
                pytest.fail(f"{name}: unexpected variable {key}")
        # Every setting value parses (types, bounds) as the gateway would parse it.
        env = {k: v for k, v in environment_of(service).items() if k.startswith("ISOGATE_")}
        Settings(**{k.removeprefix("ISOGATE_").lower(): v for k, v in env.items()})


def test_compose_policies_resolve_to_the_compose_workers(services: dict, monkeypatch) -> None:
    replica = next(iter(_gateway_replicas(services).values()))
    env = environment_of(replica)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    mount = next(v for v in replica["volumes"] if v.split(":")[1] == env["ISOGATE_POLICIES_DIR"])
    policies = load_policies(REPO_ROOT / mount.split(":")[0])
    model = policies.models[env["POLICY_MODEL_NAME"]]
    assert model.require_engine_tags
    assert str(model.tokenizer) == env["POLICY_TOKENIZER_DIR"]
    (pool,) = model.pools
    prefill, decode = services["sglang-prefill"], services["sglang-decode"]
    assert pool.prefill[0].url == f"http://sglang-prefill:{environment_of(prefill)['SGLANG_PORT']}"
    assert pool.prefill[0].bootstrap_port == int(environment_of(prefill)["SGLANG_BOOTSTRAP_PORT"])
    assert pool.decode[0].url == f"http://sglang-decode:{environment_of(decode)['SGLANG_PORT']}"
    # The model directory the tokenizer is read from is the one the workers serve.
    model_mounts = {v.rsplit(":", 2)[0] for v in replica["volumes"] if ":/models/model" in v}
    assert model_mounts == {
        v.rsplit(":", 2)[0] for v in prefill["volumes"] if ":/models/model" in v
    }


def test_the_load_balancer_sends_to_both_replicas(services: dict) -> None:
    conf = (REPO_ROOT / "docker" / "nginx.conf").read_text()
    upstreams = set(re.findall(r"server\s+([\w-]+):8080", conf))
    assert upstreams == set(_gateway_replicas(services))
    assert "proxy_buffering off" in conf, "SSE must not be buffered"
    assert set(depends_on(services["lb"])) == set(_gateway_replicas(services))


def test_the_replicas_trust_exactly_the_load_balancers_address(compose: dict) -> None:
    """Behind the lb every client shares its address: the replicas read the client from its
    X-Forwarded-For, and trust that header from the lb alone, whose address is fixed inside
    the network's subnet and outside the range other containers are given."""
    import ipaddress

    services = compose["services"]
    lb_address = ipaddress.ip_address(services["lb"]["networks"]["default"]["ipv4_address"])
    (pool,) = compose["networks"]["default"]["ipam"]["config"]
    assert lb_address in ipaddress.ip_network(pool["subnet"])
    assert lb_address not in ipaddress.ip_network(pool["ip_range"])
    for name, replica in _gateway_replicas(services).items():
        trusted = environment_of(replica)["ISOGATE_FORWARDED_ALLOW_IPS"]
        assert [ipaddress.ip_address(a.strip()) for a in trusted.split(",")] == [lb_address], name
    conf = (REPO_ROOT / "docker" / "nginx.conf").read_text()
    assert "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;" in conf


def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    """Docker's own parser, which needs no engine: the v2 plugin (``docker compose``) where it is
    installed, else Debian's ``docker-compose`` 1.29 (apt package docker-compose), which checks
    the same schema but predates the top-level ``name`` key, so it reads a copy without it."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        command, compose_file = [docker, "compose"], COMPOSE_FILE
    elif shutil.which("docker-compose"):
        compose_file = tmp_path / "compose.yaml"
        compose_file.write_text(re.sub(r"(?m)^name: .*\n", "", COMPOSE_FILE.read_text()))
        command = ["docker-compose"]
    else:
        pytest.skip(
            "neither `docker compose` nor `docker-compose` here; the structural tests stand in"
        )
    result = subprocess.run(
        [
            *command,
            "-f",
            str(compose_file),
            "--project-directory",
            str(REPO_ROOT),
            "--env-file",
            str(ENV_EXAMPLE),
            "config",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert (
        interpolate("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $${SET}", env) == "v d d  ${SET}"
    )
    with pytest.raises(MissingVariable):
        interpolate("${EMPTY:?needed}", env)
    assert Path(COMPOSE_FILE).is_file()
