"""Which models a tenant may call (tenants.yaml ``models``): one lookup for every route, and a
model the tenant may not use answered exactly as one that does not exist."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.common.errors import APIError
from gateway.config.policies import PolicyError, load_policies
from gateway.tenancy.store import audit_row_json


def _pool(name: str = "shared", dedicated_to: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "name": name,
        "dedicated_to": list(dedicated_to),
        "prefill": [{"url": "http://127.0.0.1:9", "bootstrap_port": 1}],
        "decode": [{"url": "http://127.0.0.1:9"}],
    }


def write(
    directory: Path,
    *,
    tenants: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
    models: tuple[str, ...] = ("small", "large"),
    **models_extra: Any,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "models": [
            {"name": name, "tokenizer": "tok", "max_context_tokens": 4096, "pools": [_pool()]}
            for name in models
        ],
        **models_extra,
    }
    (directory / "models.yaml").write_text(yaml.safe_dump(document))
    tenants_file: dict[str, Any] = {"tenants": tenants or {}}
    if defaults is not None:
        tenants_file["defaults"] = defaults
    (directory / "tenants.yaml").write_text(yaml.safe_dump(tenants_file))
    return directory


def _refusal(call: Any) -> APIError:
    with pytest.raises(APIError) as raised:
        call()
    return raised.value


def test_a_tenant_without_a_models_list_may_call_every_model(tmp_path: Path) -> None:
    policies = load_policies(write(tmp_path, tenants={"acme": {}}))
    assert policies.resolve_model("acme", "large").name == "large"
    assert [m.name for m in policies.visible_models("acme")] == ["small", "large"]


def test_a_model_outside_the_list_is_the_same_404_as_one_that_does_not_exist(
    tmp_path: Path,
) -> None:
    policies = load_policies(write(tmp_path, tenants={"acme": {"models": ["small"]}}))
    assert policies.resolve_model("acme", "small").name == "small"
    assert [m.name for m in policies.visible_models("acme")] == ["small"]

    forbidden = _refusal(lambda: policies.resolve_model("acme", "large"))
    # An unknown model given the same name length, so that only existence differs.
    absent = _refusal(lambda: policies.resolve_model("acme", "lunch"))
    assert forbidden.status == absent.status == 404
    assert forbidden.body() == {
        "error": {
            "message": "The model 'large' does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert absent.body()["error"]["message"] == "The model 'lunch' does not exist."
    assert forbidden.headers == absent.headers
    # Only the audit is told why.
    assert forbidden.audit_detail == "tenant 'acme' may not use model 'large'"
    assert absent.audit_detail is None


def test_the_admin_sees_every_model(tmp_path: Path) -> None:
    policies = load_policies(write(tmp_path, defaults={"models": ["small"]}))
    assert [m.name for m in policies.visible_models(None)] == ["small", "large"]
    assert policies.resolve_model(None, "large").name == "large"


def test_defaults_models_apply_to_a_tenant_not_listed(tmp_path: Path) -> None:
    policies = load_policies(write(tmp_path, defaults={"models": ["small"]}))
    assert [m.name for m in policies.visible_models("anyone")] == ["small"]
    assert _refusal(lambda: policies.resolve_model("anyone", "large")).code == "model_not_found"


@pytest.mark.parametrize(
    ("tenants", "defaults", "where"),
    [
        ({"acme": {"models": ["huge"]}}, None, "tenants.acme.models"),
        ({}, {"models": ["huge"]}, "defaults.models"),
    ],
)
def test_a_models_list_naming_no_model_is_refused_naming_file_and_field(
    tmp_path: Path, tenants: dict[str, Any], defaults: dict[str, Any] | None, where: str
) -> None:
    with pytest.raises(PolicyError) as raised:
        load_policies(write(tmp_path, tenants=tenants, defaults=defaults))
    message = str(raised.value)
    assert "tenants.yaml" in message
    assert where in message
    assert "'huge'" in message


def _event(code: str, detail: str | None) -> dict[str, Any]:
    return {
        "generation_id": "gen-1",
        "tenant_id": "acme",
        "key_id": None,
        "model": "large",
        "outcome": "rejected",
        "status": 404,
        "code": code,
        "prefill_worker": None,
        "decode_worker": None,
        "pool": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "stream": False,
        "latency_ms": 1.0,
        "created_at": datetime(2026, 1, 1, tzinfo=UTC),
        "detail": detail,
    }


def test_why_a_model_was_not_found_is_shown_to_the_admin_only() -> None:
    row = _event("model_not_found", "tenant 'acme' may not use model 'large'")
    assert audit_row_json(row, admin=True)["detail"] == "tenant 'acme' may not use model 'large'"
    assert audit_row_json(row, admin=False)["detail"] is None
    other = _event("invalid_value", "max_tokens is too large")
    assert audit_row_json(other, admin=False)["detail"] == "max_tokens is too large"


# ---- aliases (models.yaml ``aliases``) ------------------------------------------------------


def test_an_alias_resolves_to_its_model_and_is_listed_with_the_tenants_models(
    tmp_path: Path,
) -> None:
    policies = load_policies(
        write(
            tmp_path,
            tenants={"acme": {"models": ["small"]}},
            aliases={"gpt-4o-mini": "small", "gpt-4o": "large"},
        )
    )
    assert policies.resolve_model("acme", "gpt-4o-mini").name == "small"
    names = [(name, model.name) for name, model in policies.public_names("acme")]
    assert names == [("small", "small"), ("gpt-4o-mini", "small")]
    # An alias of a model the tenant may not use is as unknown as the model itself.
    refused = _refusal(lambda: policies.resolve_model("acme", "gpt-4o"))
    assert refused.body()["error"]["message"] == "The model 'gpt-4o' does not exist."
    assert refused.audit_detail == "tenant 'acme' may not use model 'large'"


@pytest.mark.parametrize(
    ("aliases", "reason"),
    [
        ({"large": "small"}, "aliases.large: shadows the model of that name"),
        ({"gpt-4o": "huge"}, "aliases.gpt-4o: no such model 'huge'"),
    ],
)
def test_an_alias_that_shadows_a_model_or_names_none_is_refused(
    tmp_path: Path, aliases: dict[str, str], reason: str
) -> None:
    with pytest.raises(PolicyError) as raised:
        load_policies(write(tmp_path, aliases=aliases))
    assert "models.yaml" in str(raised.value)
    assert reason in str(raised.value)


# ---- a key's narrowing of its tenant's models -----------------------------------------------


def test_a_key_narrows_its_tenants_models_and_never_widens_them(tmp_path: Path) -> None:
    policies = load_policies(
        write(
            tmp_path,
            models=("small", "large", "huge"),
            tenants={"acme": {"models": ["small", "large"]}},
            aliases={"mini": "small"},
        )
    )
    narrow = ("small", "huge")
    assert [n for n, _ in policies.public_names("acme", narrow)] == ["small", "mini"]
    assert policies.resolve_model("acme", "mini", narrow).name == "small"
    by_key = _refusal(lambda: policies.resolve_model("acme", "large", narrow))
    assert by_key.body() == model_not_found_body("large")
    assert by_key.audit_detail == "the key may not use model 'large' (its models)"
    # The key names a model its tenant may not call: still refused, for the tenant's reason.
    by_tenant = _refusal(lambda: policies.resolve_model("acme", "huge", narrow))
    assert by_tenant.audit_detail == "tenant 'acme' may not use model 'huge'"


def model_not_found_body(name: str) -> dict[str, Any]:
    return {
        "error": {
            "message": f"The model '{name}' does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
