"""``isogate policies check``: the shipped directory passes; each kind of bad directory fails,
naming the file, the field and the reason; ``--live``'s comparison names what would change."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli.main import main
from gateway.cli.policies_check import live_changes
from gateway.config.policies import load_policies
from tests.unit.config.test_model_access import write

SHIPPED = Path(__file__).resolve().parents[3] / "policies"


def test_the_shipped_directory_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies", "check", str(SHIPPED)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {SHIPPED}: 1 model(s)")


def _edit(directory: Path, name: str, change: Any) -> None:
    document = yaml.safe_load((directory / name).read_text())
    change(document)
    (directory / name).write_text(yaml.safe_dump(document))


def _dedicate(pool_to: str) -> Any:
    def change(models: dict[str, Any]) -> None:
        models["models"][1]["pools"][0]["dedicated_to"] = [pool_to]

    return change


BAD: dict[str, tuple[str, Any, str]] = {
    "schema": (
        "tenants.yaml",
        lambda t: t["tenants"].update({"acme": {"limits": {"requests_per_minute": "many"}}}),
        "tenants.yaml: tenants.acme.limits.requests_per_minute: Input should be a valid integer",
    ),
    "unknown field": (
        "models.yaml",
        lambda m: m["models"][0].update({"max_contxt_tokens": 5}),
        "models.yaml: models.0.max_contxt_tokens: Extra inputs are not permitted",
    ),
    "a tenant's model that does not exist": (
        "tenants.yaml",
        lambda t: t["tenants"].update({"acme": {"models": ["huge"]}}),
        "tenants.yaml: tenants.acme.models: no such model 'huge' in models.yaml",
    ),
    "limits on a model that does not exist": (
        "tenants.yaml",
        lambda t: t["tenants"].update({"acme": {"model_limits": {"huge": {}}}}),
        "tenants.yaml: tenants.acme.model_limits: no such model 'huge' in models.yaml",
    ),
    "an alias that shadows a model": (
        "models.yaml",
        lambda m: m.update({"aliases": {"large": "small"}}),
        "models.yaml: aliases.large: shadows the model of that name",
    ),
    "an alias of no model": (
        "models.yaml",
        lambda m: m.update({"aliases": {"gpt-4o": "huge"}}),
        "models.yaml: aliases.gpt-4o: no such model 'huge'",
    ),
    "a pool dedicated to a tenant that does not exist": (
        "models.yaml",
        _dedicate("ghost"),
        "models.yaml: models.large.pools.0.dedicated_to: tenant 'ghost' is not in tenants.yaml",
    ),
    "a pool dedicated to a shared tenant": (
        "both",
        None,
        "models.yaml: models.large.pools.0.dedicated_to: tenant 'acme' is of class shared: "
        "it is never routed to pool 'shared'",
    ),
    "a dedicated tenant that may call no model of its pools": (
        "dedicated",
        None,
        "tenants.yaml: tenants.acme.models: dedicated, but none of the models it may call has "
        "a pool dedicated to it",
    ),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_each_kind_of_bad_directory_fails_naming_file_field_and_reason(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = write(tmp_path)
    name, change, expected = BAD[kind]
    if name == "both":
        _edit(directory, "models.yaml", _dedicate("acme"))
        _edit(directory, "tenants.yaml", lambda t: t["tenants"].update({"acme": {}}))
    elif name == "dedicated":
        _edit(directory, "models.yaml", _dedicate("acme"))
        _edit(
            directory,
            "tenants.yaml",
            lambda t: t["tenants"].update(
                {"acme": {"isolation": "dedicated", "models": ["small"]}}
            ),
        )
    else:
        _edit(directory, name, change)
    assert main(["policies", "check", str(directory)]) == 1
    assert expected in capsys.readouterr().err


def test_a_file_that_is_not_yaml_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = write(tmp_path)
    (directory / "tenants.yaml").write_text("tenants: [unclosed\n")
    assert main(["policies", "check", str(directory)]) == 1
    assert "tenants.yaml: (file): not valid YAML" in capsys.readouterr().err


def test_the_live_comparison_names_every_change_and_the_prompt_sizes_refused_after(
    tmp_path: Path,
) -> None:
    live = load_policies(
        write(tmp_path / "live", tenants={"acme": {}, "gone": {}}, aliases={"gpt": "small"})
    ).summary()
    directory = write(
        tmp_path / "new",
        models=("small", "huge"),
        tenants={"acme": {"limits": {"requests_per_minute": 5}}, "fresh": {}},
        aliases={"gpt": "huge", "mini": "small"},
    )
    _edit(directory, "models.yaml", lambda m: m["models"][0].update({"max_context_tokens": 1000}))
    new = load_policies(directory).summary()
    # Every worker of the pool has a KV pool of 3000 tokens: today's bound is the policy's 4096
    # cut to 3000 by the pool; after, 1000 by the policy.
    changes = list(live_changes(live, new, {"http://127.0.0.1:9": 3000}))
    assert changes == [
        "model added: huge",
        "model removed: large",
        "alias moved: gpt: small -> huge",
        "alias added: mini -> small",
        "tenant added: fresh",
        "tenant removed: gone",
        "models.small.max_context_tokens: 4096 -> 1000",
        "tenants.acme.limits.requests_per_minute: 600 -> 5",
        "models.large: removed: prompts of up to 3000 tokens (prompt + max_tokens) admitted "
        "today would be refused",
        "models.small: prompts of 1001 to 3000 tokens (prompt + max_tokens) are admitted today "
        "(pool 'shared''s KV pool) and would be refused after (max_context_tokens)",
    ]
    assert list(live_changes(live, live, {})) == []


def test_without_the_admin_key_live_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ISOGATE_ADMIN_KEY", raising=False)
    shutil.copytree(SHIPPED, tmp_path / "p")
    assert main(["policies", "check", str(tmp_path / "p"), "--live", "http://127.0.0.1:9"]) == 2
    assert "ISOGATE_ADMIN_KEY" in capsys.readouterr().err
