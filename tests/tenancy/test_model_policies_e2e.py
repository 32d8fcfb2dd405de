"""The platform team's model policies on a running gateway (issue 45): model access per
tenant, aliases, limits per model and per (tenant, model), token budgets."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.tenancy.policy_stack import MODEL, OTHER_MODEL, chat, policy_stack
from tests.verification.stack import gateway_metric, wait_until


def _only_tiny_llama(models: dict[str, Any], tenants: dict[str, Any]) -> None:
    tenants["tenants"]["narrow"] = {"models": [MODEL]}


def test_a_tenant_without_access_gets_the_unknown_models_404_and_its_audit_says_why(
    tmp_path: Path,
) -> None:
    with policy_stack(tmp_path, _only_tiny_llama, redis=False) as stack:
        narrow, wide = stack.key("narrow"), stack.key("wide")
        with stack.client(narrow) as client:
            listed = [card["id"] for card in client.get("/v1/models").json()["data"]]
            assert listed == [MODEL]
            assert client.post("/v1/chat/completions", json=chat(MODEL)).status_code == 200

            refused = client.post("/v1/chat/completions", json=chat(OTHER_MODEL))
            # A model of the same name length that does not exist: the bodies differ only
            # by the name.
            absent = client.post("/v1/chat/completions", json=chat("absent-mode"))
            assert refused.status_code == absent.status_code == 404
            assert refused.json()["error"] == {
                **absent.json()["error"],
                "message": f"The model '{OTHER_MODEL}' does not exist.",
            }
            assert absent.json()["error"]["code"] == "model_not_found"
            # Every route that names a model answers the same.
            for path, body in (
                ("/v1/tokenize", {"model": OTHER_MODEL, "prompt": "hi"}),
                ("/v1/detokenize", {"model": OTHER_MODEL, "tokens": [1]}),
            ):
                answer = client.post(path, json=body)
                assert answer.status_code == 404
                assert answer.json()["error"]["code"] == "model_not_found"
            card = client.get(f"/v1/models/{OTHER_MODEL}")
            assert card.status_code == 404
            assert card.json()["error"]["code"] == "model_not_found"
            tenant_view = wait_until(
                lambda: [
                    e
                    for e in client.get("/v1/audit/events").json()["data"]
                    if e["model"] == OTHER_MODEL
                ],
                timeout_s=10,
            )
            # The tenant's own view does not say whether the model exists.
            assert tenant_view[0]["detail"] is None

        with stack.client(wide) as client:
            listed = [card["id"] for card in client.get("/v1/models").json()["data"]]
            assert listed == [MODEL, OTHER_MODEL]
            assert client.post("/v1/chat/completions", json=chat(OTHER_MODEL)).status_code == 200

        (event,) = [e for e in stack.audit(tenant="narrow") if e["model"] == OTHER_MODEL]
        assert (event["status"], event["code"]) == (404, "model_not_found")
        assert event["detail"] == f"tenant 'narrow' may not use model '{OTHER_MODEL}'"
        (unknown,) = [e for e in stack.audit(tenant="narrow") if e["model"] == "absent-mode"]
        assert unknown["detail"] == "The model 'absent-mode' does not exist."


ALIAS = "gpt-4o-mini"


def _alias(models: dict[str, Any], tenants: dict[str, Any]) -> None:
    models["aliases"] = {ALIAS: MODEL}


def test_an_alias_is_served_under_its_name_and_audited_under_both(tmp_path: Path) -> None:
    with policy_stack(tmp_path, _alias, redis=False) as stack:
        key = stack.key("aliased")
        with stack.client(key) as client:
            listed = [card["id"] for card in client.get("/v1/models").json()["data"]]
            assert listed == [MODEL, OTHER_MODEL, ALIAS]
            assert client.get(f"/v1/models/{ALIAS}").json()["id"] == ALIAS
            whole = client.post("/v1/chat/completions", json=chat(ALIAS))
            assert whole.status_code == 200, whole.text
            assert whole.json()["model"] == ALIAS
            streamed = client.post("/v1/chat/completions", json={**chat(ALIAS), "stream": True})
            chunks = [
                line.removeprefix("data: ")
                for line in streamed.text.splitlines()
                if line.startswith("data: {")
            ]
            assert chunks and all(f'"model":"{ALIAS}"' in chunk for chunk in chunks)
            counted = client.post("/v1/tokenize", json={"model": ALIAS, "prompt": "hi"})
            assert counted.status_code == 200, counted.text
            own = client.post("/v1/chat/completions", json=chat(MODEL)).json()
        events = wait_until(
            lambda: (
                [e for e in stack.audit(tenant="aliased") if e["outcome"] == "served"]
                if len(stack.audit(tenant="aliased")) >= 3
                else None
            ),
            timeout_s=10,
        )
        by_id = {e["generation_id"]: e for e in events}
        assert (by_id[whole.json()["id"]]["model"], by_id[whole.json()["id"]]["policy_model"]) == (
            ALIAS,
            MODEL,
        )
        assert (by_id[own["id"]]["model"], by_id[own["id"]]["policy_model"]) == (MODEL, MODEL)
        assert sorted((e["model"], e["policy_model"]) for e in events) == [
            (ALIAS, MODEL),
            (ALIAS, MODEL),
            (MODEL, MODEL),
        ]


def _model_limits(models: dict[str, Any], tenants: dict[str, Any]) -> None:
    # tiny-llama: 4 requests a minute from every tenant together; "capped": 2 on it.
    models["models"][0]["limits"] = {"requests_per_minute": 4}
    tenants["tenants"]["capped"] = {"model_limits": {MODEL: {"requests_per_minute": 2}}}


def test_model_and_tenant_on_model_limits_hold_across_two_replicas_sharing_redis(
    tmp_path: Path,
) -> None:
    with policy_stack(tmp_path, _model_limits, replicas=2) as stack:
        capped, free = stack.key("capped"), stack.key("free")
        answers = []
        for replica in (0, 1):
            with stack.client(capped, replica) as client:
                answers.append(client.post("/v1/chat/completions", json=chat(MODEL)))
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[1].headers["x-ratelimit-scope-requests"] == "tenant on model tiny-llama"
        assert answers[1].headers["x-ratelimit-remaining-requests"] == "0"
        with stack.client(capped, 0) as client:
            third = client.post("/v1/chat/completions", json=chat(MODEL))
            assert third.status_code == 429
            assert third.json()["error"]["message"] == (
                "Rate limit reached (tenant on model tiny-llama): 2 requests per minute."
            )
            assert third.headers["x-ratelimit-scope"] == "tenant on model tiny-llama"
            # Its other model is not capped.
            assert client.post("/v1/chat/completions", json=chat(OTHER_MODEL)).status_code == 200
        # The model's own 4 a minute: the capped tenant's 2 served and the free one's 2.
        statuses = []
        for replica in (1, 0, 1):
            with stack.client(free, replica) as client:
                statuses.append(client.post("/v1/chat/completions", json=chat(MODEL)))
        assert [s.status_code for s in statuses] == [200, 200, 429]
        assert statuses[2].json()["error"]["message"] == (
            "Rate limit reached (model tiny-llama): 4 requests per minute."
        )
        assert statuses[2].headers["x-ratelimit-scope"] == "model tiny-llama"


BUDGET = 200


def _daily_budget(models: dict[str, Any], tenants: dict[str, Any]) -> None:
    tenants["tenants"]["metered"] = {
        "budget": {"tokens": BUDGET, "period": "day", "soft_percent": 50}
    }


def _spend_budget(stack: Any, key: str, counted: Callable[[], int | None]) -> int:
    """Requests alternating between the replicas until one is refused; each next one is sent
    once the last one's tokens are counted (``counted``: the shared count, where it can be
    read). Returns how many were served; checks the refusal and that the count was right:
    served while the budget was not spent, refused once it was."""
    used = 0
    for served in range(100):
        with stack.client(key, served % len(stack.gateways)) as client:
            answer = client.post("/v1/chat/completions", json=chat(MODEL))
        if answer.status_code == 429:
            assert answer.json()["error"]["code"] == "budget_exceeded"
            assert answer.headers["x-budget-remaining-tokens"] == "0"
            assert used >= BUDGET  # refused only once spent
            return served
        assert answer.status_code == 200, answer.text
        assert used < BUDGET  # served only while not spent
        assert int(answer.headers["x-budget-remaining-tokens"]) == BUDGET - used
        used += answer.json()["usage"]["total_tokens"]
        wait_until(lambda expected=used: counted() == expected, timeout_s=10)
    raise AssertionError("never refused")


def test_a_daily_budget_holds_across_two_replicas_sharing_redis_and_a_restart(
    tmp_path: Path,
) -> None:
    import redis

    with policy_stack(tmp_path, _daily_budget, replicas=2) as stack:
        key = stack.key("metered")
        prefix = stack.gateway.env["ISOGATE_REDIS_KEY_PREFIX"]
        client = redis.Redis.from_url(stack.gateway.env["ISOGATE_REDIS_URL"])
        today = datetime.now(UTC).strftime("%Y-%m-%d")

        def counted() -> int | None:
            found = client.get(f"{prefix}:{{metered}}:budget:*:{today}")
            return None if found is None else int(found)

        served = _spend_budget(stack, key, counted)
        assert served >= 2  # the count went through both replicas
        crossings = sum(
            gateway_metric(g, "isogate_budget_soft_crossings_total", tenant="metered")
            for g in stack.gateways
        )
        assert crossings == 1
        # Both replicas restarted: the count is Redis's, kept.
        for gateway in stack.gateways:
            gateway.stop()
            gateway.start(timeout_s=30)
        for replica in (0, 1):
            with stack.client(key, replica) as c:
                assert c.post("/v1/chat/completions", json=chat(MODEL)).status_code == 429
        # Redis lost its keys: rebuilt from the audit log.
        client.delete(f"{prefix}:{{metered}}:budget:*:{today}")
        with stack.client(key, 1) as c:
            refused = c.post("/v1/chat/completions", json=chat(MODEL))
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "budget_exceeded"
        client.close()


def test_a_daily_budget_survives_a_restart_without_redis(tmp_path: Path) -> None:
    with policy_stack(tmp_path, _daily_budget, redis=False) as stack:
        key = stack.key("metered")
        _spend_budget(stack, key, lambda: _used_per_audit(stack))
        stack.gateway.stop()
        stack.gateway.start(timeout_s=30)
        with stack.client(key) as client:
            refused = client.post("/v1/chat/completions", json=chat(MODEL))
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "budget_exceeded"


def _used_per_audit(stack: Any) -> int:
    """Without Redis the count is not readable from outside; the audit log (which the budget
    is rebuilt from) stands in as what was used."""
    return sum(
        (e["prompt_tokens"] or 0) + (e["completion_tokens"] or 0)
        for e in stack.audit(tenant="metered")
        if e["completion_tokens"] is not None
    )


def test_policies_check_live_names_what_a_change_would_do_on_a_running_gateway(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import yaml

    from gateway.cli.main import main

    with policy_stack(tmp_path / "stack", redis=False) as stack:
        changed = tmp_path / "changed"
        shutil.copytree(stack.policies, changed)
        models = yaml.safe_load((changed / "models.yaml").read_text())
        models["models"][0]["max_context_tokens"] = 4096
        models["aliases"] = {ALIAS: MODEL}
        (changed / "models.yaml").write_text(yaml.safe_dump(models))
        tenants = yaml.safe_load((changed / "tenants.yaml").read_text())
        tenants["tenants"]["newcomer"] = {"limits": {"requests_per_minute": 10}}
        (changed / "tenants.yaml").write_text(yaml.safe_dump(tenants))
        monkeypatch.setenv("ISOGATE_ADMIN_KEY", stack.gateway.admin_key)
        assert main(["policies", "check", str(changed), "--live", stack.gateway.url]) == 0
    out = capsys.readouterr().out
    assert f"  alias added: {ALIAS} -> {MODEL}\n" in out
    assert "  tenant added: newcomer\n" in out
    assert f"  models.{MODEL}.max_context_tokens: 8192 -> 4096\n" in out
    # The stand-in workers' KV pools hold 8192 tokens: today the policy's 8192 binds.
    assert (
        f"  models.{MODEL}: prompts of 4097 to 8192 tokens (prompt + max_tokens) are admitted "
        "today (max_context_tokens) and would be refused after (max_context_tokens)\n"
    ) in out


def test_a_key_narrowed_to_one_model_is_refused_the_other_as_if_absent(tmp_path: Path) -> None:
    with policy_stack(tmp_path, _alias, redis=False) as stack:
        wide = stack.key("narrowed")
        with stack.gateway.admin() as admin:
            created = admin.post(
                "/admin/tenants/narrowed/keys", json={"name": "ci", "models": [OTHER_MODEL]}
            )
            assert created.status_code == 201, created.text
            assert created.json()["models"] == [OTHER_MODEL]
            bad = admin.post("/admin/tenants/narrowed/keys", json={"models": ["no-such"]})
            assert bad.status_code == 400
        narrow = created.json()["key"]
        with stack.client(narrow) as client:
            listed = [card["id"] for card in client.get("/v1/models").json()["data"]]
            assert listed == [OTHER_MODEL]
            assert client.post("/v1/chat/completions", json=chat(OTHER_MODEL)).status_code == 200
            for name in (MODEL, ALIAS):
                refused = client.post("/v1/chat/completions", json=chat(name))
                assert refused.status_code == 404
                assert refused.json()["error"]["message"] == f"The model '{name}' does not exist."
            counted = client.post("/v1/tokenize", json={"model": MODEL, "prompt": "hi"})
            assert counted.status_code == 404
        with stack.client(wide) as client:  # the tenant's other key: every model
            assert client.post("/v1/chat/completions", json=chat(MODEL)).status_code == 200
        details = {e["model"]: e["detail"] for e in stack.audit(tenant="narrowed")}
        assert details[MODEL] == f"the key may not use model '{MODEL}' (its models)"


def test_a_budget_counts_a_request_in_flight_before_its_response(tmp_path: Path) -> None:
    """While one request that may use more than the budget runs, the next is refused; once
    it has ended, what it did not use is the tenant's again."""
    with policy_stack(tmp_path, _daily_budget) as stack:
        key = stack.key("metered")
        gate = threading.Event()
        stack.decode.behaviour.gate = gate
        first: list[Any] = []

        def send_first() -> None:
            with stack.client(key) as client:
                first.append(client.post("/v1/chat/completions", json=chat(MODEL, BUDGET)))

        runs = threading.Thread(target=send_first)
        runs.start()
        try:
            wait_until(lambda: stack.decode.in_flight == 1, timeout_s=10)
            with stack.client(key) as client:
                refused = client.post("/v1/chat/completions", json=chat(MODEL))
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "budget_exceeded"
        finally:
            gate.set()
            runs.join(timeout=30)
        assert first[0].status_code == 200, first[0].text
        used = first[0].json()["usage"]["total_tokens"]
        assert used < BUDGET
        with stack.client(key) as client:
            wait_until(
                lambda: client.post("/v1/chat/completions", json=chat(MODEL)).status_code == 200,
                timeout_s=10,
            )
