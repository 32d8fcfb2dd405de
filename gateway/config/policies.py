"""The platform team's declarative policies: models, worker pools, tenants and their limits.

``policies/models.yaml`` and ``policies/tenants.yaml`` are validated here. A bad file is
a ``PolicyError`` naming the file and the field, raised at start and on reload (where the
previous policies stay in force). ``${VAR}`` and ``${VAR:-default}`` in a file are expanded
from the environment, so one file serves a laptop and a compose deployment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.common.errors import model_not_found
from gateway.tool_parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

IsolationClass = Literal["shared", "dedicated"]

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


Priority = Literal["high", "normal", "low"]


@dataclass(slots=True)  # built per request: not frozen (see gateway.core.generation)
class Share:
    """A tenant's claim on a contended pair: its weight within its priority class."""

    tenant_id: str
    weight: float = 1.0
    priority: Priority = "normal"


class PolicyError(Exception):
    """A policy file that cannot be used; the message names the file and what is wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefillWorker(_Strict):
    url: str
    bootstrap_port: int = Field(ge=1, le=65535)
    # Host decode uses to reach prefill's bootstrap server; defaults to the URL's host.
    bootstrap_host: str | None = None

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, url: str) -> str:
        return _http_url(url)


class DecodeWorker(_Strict):
    url: str

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, url: str) -> str:
        return _http_url(url)


class WorkerPool(_Strict):
    name: str
    # Empty: a shared pool. Otherwise only these tenants (of class "dedicated") use it.
    dedicated_to: tuple[str, ...] = ()
    prefill: tuple[PrefillWorker, ...] = Field(min_length=1)
    decode: tuple[DecodeWorker, ...] = Field(min_length=1)
    # Requests in flight per (prefill, decode) pair of this pool before the rest queue
    # (gateway.core.pair_queues); unset: derived from what the engine reports and the setting.
    max_in_flight_per_pair: int | None = Field(default=None, gt=0)
    # The same while more than one tenant holds or wants slots of the pair: lower, so that a
    # tenant's request does not share the engine's batch with a flood of another's.
    max_in_flight_per_pair_contended: int | None = Field(default=None, gt=0)
    # The most of a pair one request may hold at once: this fraction of its slots (sequences
    # in flight: each generation of ``n``, ``best_of`` and a list of prompts is one) and of its
    # KV pool (one generation alone is bounded by the pool only). A whole answer with more runs
    # them a bounded number at a time; a stream, whose generations run together, past it is a
    # 400.
    max_request_share: float = Field(default=0.5, gt=0, le=1)


# An unset limit of a model or of a tenant on a model: a bucket no traffic empties.
UNBOUNDED = 1 << 40


class ScopeLimits(_Strict):
    """Limits on top of a tenant's own: a model's as a whole (every tenant's traffic to it
    together) or a tenant's on one model. Each unset one does not bound."""

    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    max_concurrent: int | None = Field(default=None, gt=0)

    def as_limits(self) -> TenantLimits:
        return TenantLimits(
            requests_per_minute=self.requests_per_minute or UNBOUNDED,
            tokens_per_minute=self.tokens_per_minute or UNBOUNDED,
            max_concurrent=self.max_concurrent or UNBOUNDED,
        )


class ModelPolicy(_Strict):
    name: str = Field(min_length=1)
    # Directory holding the model's own tokenizer.json and tokenizer_config.json
    # (relative paths are relative to the policies directory).
    tokenizer: Path
    # The policy's own bound on prompt + completion, on top of what the pools allow.
    max_context_tokens: int = Field(gt=0)
    default_max_tokens: int = Field(default=256, gt=0)
    max_output_tokens: int = Field(default=4096, gt=0)
    # Workers that do not echo isolation tags (no engine_patch) are never routed to.
    require_engine_tags: bool = True
    # The texts of the tokenizer's special and added tokens in a chat message: encoded as
    # "plain" text (only the template's own text yields control tokens) or "refuse"d (400).
    chat_control_text: Literal["plain", "refuse"] = "plain"
    # In a completion prompt (the tenant writes all of it): "recognise"d as the tokens, as the
    # tokenizer does by default, encoded as "plain" text, or "refuse"d.
    prompt_control_text: Literal["recognise", "plain", "refuse"] = "recognise"
    # How the model writes tool calls and reasoning (SGLang's parser names); a model without a
    # tool_call_parser refuses requests with tools.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # Every tenant's traffic to this model together (protecting its pools), on top of each
    # tenant's own limits; absent: none.
    limits: ScopeLimits | None = None

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, name: str | None) -> str | None:
        if name is not None and name not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool_call_parser {name!r}; known: {sorted(TOOL_CALL_PARSERS)}"
            )
        return name

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, name: str | None) -> str | None:
        if name is not None and name not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning_parser {name!r}; known: {sorted(REASONING_PARSERS)}"
            )
        return name

    pools: tuple[WorkerPool, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _pool_names_unique(self) -> ModelPolicy:
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique within a model: {names}")
        return self


class ModelsFile(_Strict):
    models: tuple[ModelPolicy, ...] = Field(min_length=1)
    # Public names served as a model of this file (``gpt-4o-mini: tiny-llama``), so that
    # clients written for another provider need no change.
    aliases: dict[str, str] = {}

    @model_validator(mode="after")
    def _model_names_unique(self) -> ModelsFile:
        names = [model.name for model in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        return self

    @model_validator(mode="after")
    def _aliases_name_models(self) -> ModelsFile:
        names = {model.name for model in self.models}
        for alias, target in self.aliases.items():
            if alias in names:
                raise ValueError(f"aliases.{alias}: shadows the model of that name")
            if target not in names:
                raise ValueError(f"aliases.{alias}: no such model {target!r}")
        return self


class TenantLimits(_Strict):
    requests_per_minute: int = Field(default=600, gt=0)
    tokens_per_minute: int = Field(default=1_000_000, gt=0)
    max_concurrent: int = Field(default=64, gt=0)


class TokenBudget(_Strict):
    """Prompt + completion tokens a tenant may use over a UTC day or calendar month."""

    tokens: int = Field(gt=0)
    period: Literal["day", "month"]
    # Past this share of the budget a request is still served, but logged and counted
    # (isogate_budget_soft_crossings) once, so the tenant can be told before the hard stop.
    soft_percent: float = Field(default=80, gt=0, le=100)


class TenantPolicy(_Strict):
    isolation: IsolationClass = "shared"
    limits: TenantLimits = TenantLimits()
    # Its share of a contended pair within its priority class (gateway.core.fair_queue): a tenant
    # of weight 2 is served twice as often as one of weight 1 while both wait.
    weight: float = Field(default=1.0, gt=0, le=1000)
    # Strict classes: "low" is served only while no "normal" or "high" request waits.
    priority: Priority = "normal"
    # How long a stored response (the Responses API's ``store``) is kept, in days: past it,
    # no read returns it and the sweep deletes it (gateway.tenancy.stored_responses).
    response_retention_days: float = Field(default=30, gt=0, le=3650)
    # The models (their policy names in models.yaml) the tenant may call, each with its
    # aliases; absent: every model. Any other is answered as a model that does not exist.
    models: tuple[str, ...] | None = None
    # The tenant's limits on one model (by its name in models.yaml), on top of its own.
    model_limits: dict[str, ScopeLimits] = {}
    # Token budgets: over all its models, and over one model (by its name in models.yaml).
    budget: TokenBudget | None = None
    model_budgets: dict[str, TokenBudget] = {}


class TenantsFile(_Strict):
    defaults: TenantPolicy = TenantPolicy()
    tenants: dict[str, TenantPolicy] = {}


@dataclass(frozen=True)
class Policies:
    models: dict[str, ModelPolicy]
    tenant_defaults: TenantPolicy
    tenants: dict[str, TenantPolicy]
    source: Path
    # Public name -> the model's name in models.yaml.
    aliases: dict[str, str] = field(default_factory=dict)

    # Each tenant's ``Share``, made on first use: these policies never change.
    _shares: dict[str, Share] = field(default_factory=dict, compare=False, repr=False)
    # The limits of each (tenant, model) and ("", model) scope, made on first use.
    _limits: dict[tuple[str, str], TenantLimits] = field(
        default_factory=dict, compare=False, repr=False
    )

    def tenant(self, tenant_id: str) -> TenantPolicy:
        return self.tenants.get(tenant_id, self.tenant_defaults)

    def model_limits(self, model: ModelPolicy) -> TenantLimits | None:
        """The model's limits as a whole (every tenant's traffic together), if it has any."""
        return self._scope_limits(("", model.name), model.limits)

    def tenant_model_limits(self, tenant_id: str, model: ModelPolicy) -> TenantLimits | None:
        """The tenant's limits on the model, if it has any (from its policy: the defaults' for
        a tenant tenants.yaml does not list)."""
        return self._scope_limits(
            (tenant_id, model.name), self.tenant(tenant_id).model_limits.get(model.name)
        )

    def _scope_limits(
        self, key: tuple[str, str], limits: ScopeLimits | None
    ) -> TenantLimits | None:
        # Made once per (tenant, model): a pydantic model is not built per request.
        if limits is None:
            return None
        made = self._limits.get(key)
        if made is None:
            made = self._limits[key] = limits.as_limits()
        return made

    def may_use(
        self, tenant_id: str | None, model: ModelPolicy, key_models: tuple[str, ...] | None = None
    ) -> bool:
        """Whether the tenant may call the model (``None``: the admin, who may see all), and
        its key, where the key narrows the tenant's models (``key_models``)."""
        if tenant_id is None:
            return True
        allowed = self.tenant(tenant_id).models
        return (allowed is None or model.name in allowed) and (
            key_models is None or model.name in key_models
        )

    def resolve_model(
        self, tenant_id: str | None, name: str, key_models: tuple[str, ...] | None = None
    ) -> ModelPolicy:
        """The model a tenant's request names: every route looks models up here. A model that
        does not exist and one the tenant may not use are the same 404 ``model_not_found``
        (the body says nothing more: a tenant cannot probe which models exist); the error's
        ``audit_detail`` says which it was."""
        model = self.models.get(self.aliases.get(name, name))
        if model is None:
            raise model_not_found(name)
        if not self.may_use(tenant_id, model):
            error = model_not_found(name)
            error.audit_detail = f"tenant {tenant_id!r} may not use model {model.name!r}"
            raise error
        if not self.may_use(tenant_id, model, key_models):
            error = model_not_found(name)
            error.audit_detail = f"the key may not use model {model.name!r} (its models)"
            raise error
        return model

    def visible_models(
        self, tenant_id: str | None, key_models: tuple[str, ...] | None = None
    ) -> list[ModelPolicy]:
        """The models ``/v1/models`` lists: the tenant's (``None``, the admin: all), as its
        key narrows them."""
        return [
            model for model in self.models.values() if self.may_use(tenant_id, model, key_models)
        ]

    def public_names(
        self, tenant_id: str | None, key_models: tuple[str, ...] | None = None
    ) -> list[tuple[str, ModelPolicy]]:
        """Each name the tenant (with that key) may call a model by, with the model: the
        models, then the aliases of those models."""
        visible = self.visible_models(tenant_id, key_models)
        names = [(model.name, model) for model in visible]
        names += [
            (alias, self.models[target])
            for alias, target in self.aliases.items()
            if self.may_use(tenant_id, self.models[target], key_models)
        ]
        return names

    def share(self, tenant_id: str) -> Share:
        """The tenant's claim on a contended pair (its weight and priority class): one object
        per tenant for the life of these policies, so that a queue knows it by identity."""
        share = self._shares.get(tenant_id)
        if share is None:
            policy = self.tenant(tenant_id)
            share = self._shares[tenant_id] = Share(tenant_id, policy.weight, policy.priority)
        return share

    def summary(self) -> dict[str, Any]:
        """What these policies decide, as JSON: what ``isogate policies check --live`` compares
        a directory's policies with (the running gateway's, from ``/admin/policies``)."""
        return {
            "models": {
                name: {
                    "max_context_tokens": model.max_context_tokens,
                    "max_output_tokens": model.max_output_tokens,
                    "default_max_tokens": model.default_max_tokens,
                    "limits": None if model.limits is None else model.limits.model_dump(),
                    "pools": [
                        {
                            "name": pool.name,
                            "dedicated_to": list(pool.dedicated_to),
                            "prefill": [worker.url for worker in pool.prefill],
                            "decode": [worker.url for worker in pool.decode],
                        }
                        for pool in model.pools
                    ],
                }
                for name, model in self.models.items()
            },
            "aliases": dict(self.aliases),
            "tenant_defaults": self.tenant_defaults.model_dump(mode="json"),
            "tenants": {
                tenant_id: policy.model_dump(mode="json")
                for tenant_id, policy in self.tenants.items()
            },
        }

    def pools_for(self, model: ModelPolicy, tenant_id: str) -> tuple[WorkerPool, ...]:
        """The pools a tenant may be routed to: its own if dedicated, shared ones otherwise."""
        if self.tenant(tenant_id).isolation == "dedicated":
            return tuple(pool for pool in model.pools if tenant_id in pool.dedicated_to)
        return tuple(pool for pool in model.pools if not pool.dedicated_to)


def load_policies(directory: Path) -> Policies:
    directory = directory.resolve()
    models_file = _load(directory / "models.yaml", ModelsFile, required=True)
    tenants_file = _load(directory / "tenants.yaml", TenantsFile, required=False) or TenantsFile()
    models: dict[str, ModelPolicy] = {}
    for model in models_file.models:
        tokenizer = (
            model.tokenizer if model.tokenizer.is_absolute() else directory / model.tokenizer
        )
        models[model.name] = model.model_copy(update={"tokenizer": tokenizer.resolve()})
    tenants_path = directory / "tenants.yaml"
    for tenant_id, policy in [("defaults", tenants_file.defaults), *tenants_file.tenants.items()]:
        unbudgeted = [name for name in policy.model_budgets if name not in models]
        if unbudgeted:
            where = "defaults" if tenant_id == "defaults" else f"tenants.{tenant_id}"
            raise PolicyError(
                f"{tenants_path}: {where}.model_budgets: no such model {unbudgeted[0]!r} "
                "in models.yaml"
            )
        unlimited = [name for name in policy.model_limits if name not in models]
        if unlimited:
            where = "defaults" if tenant_id == "defaults" else f"tenants.{tenant_id}"
            raise PolicyError(
                f"{tenants_path}: {where}.model_limits: no such model {unlimited[0]!r} "
                "in models.yaml"
            )
        unknown = [name for name in policy.models or () if name not in models]
        if unknown:
            where = "defaults" if tenant_id == "defaults" else f"tenants.{tenant_id}"
            raise PolicyError(
                f"{tenants_path}: {where}.models: no such model {unknown[0]!r} in models.yaml"
            )
    for tenant_id, policy in tenants_file.tenants.items():
        if policy.isolation == "dedicated" and not any(
            tenant_id in pool.dedicated_to for model in models.values() for pool in model.pools
        ):
            raise PolicyError(
                f"{directory / 'tenants.yaml'}: tenant {tenant_id!r} is dedicated "
                "but no model has a pool dedicated to it"
            )
    return Policies(
        models,
        tenants_file.defaults,
        dict(tenants_file.tenants),
        directory,
        dict(models_file.aliases),
    )


_File = TypeVar("_File", bound="_Strict")


@overload
def _load(path: Path, schema: type[_File], *, required: Literal[True]) -> _File: ...
@overload
def _load(path: Path, schema: type[_File], *, required: bool) -> _File | None: ...
def _load(path: Path, schema: type[_File], *, required: bool) -> _File | None:
    if not path.exists():
        if required:
            raise PolicyError(f"{path}: missing")
        return None
    try:
        raw = yaml.safe_load(expand_env(path.read_text()))
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return schema.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise PolicyError(f"{path}: {problems}") from exc


def expand_env(text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value is None:
            if default is None:
                raise PolicyError(f"environment variable {name} is not set and has no default")
            return default
        return value

    return _ENV_REF.sub(replace, text)


def _http_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")
