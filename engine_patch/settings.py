"""Operator settings of the engine plugin, read once from the environment.

Every setting is off-by-default-safe: with no variable set the plugin enforces
everything and refuses a worker whose KV pool is smaller than its context length.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

CLAMP_CONTEXT_ENV = "ISOGATE_ENGINE_CLAMP_CONTEXT"
REQUIRE_TAGS_ENV = "ISOGATE_ENGINE_REQUIRE_TAGS"
# Comma-separated subset of {"gate", "guard", "coverage", "pages"}. Only for
# proving that each layer holds on its own (the incident replay switches the
# outer ones off to reach the inner ones); a production worker leaves it unset.
DISABLE_CHECKS_ENV = "ISOGATE_ENGINE_DISABLE_CHECKS"

_KNOWN_CHECKS = frozenset({"gate", "guard", "coverage", "pages"})


@dataclass(frozen=True)
class EngineSettings:
    clamp_context: bool = False
    require_tags: bool = False
    startup_gate: bool = True
    prompt_guard: bool = True
    coverage_check: bool = True
    page_check: bool = True

    @property
    def disabled_checks(self) -> list[str]:
        flags = {
            "gate": self.startup_gate,
            "guard": self.prompt_guard,
            "coverage": self.coverage_check,
            "pages": self.page_check,
        }
        return [name for name, enabled in flags.items() if not enabled]


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def load_settings(environ: Mapping[str, str] = os.environ) -> EngineSettings:
    disabled = {
        name.strip() for name in environ.get(DISABLE_CHECKS_ENV, "").split(",") if name.strip()
    }
    unknown = disabled - _KNOWN_CHECKS
    if unknown:
        raise ValueError(
            f"{DISABLE_CHECKS_ENV} names unknown checks {sorted(unknown)}; "
            f"known: {sorted(_KNOWN_CHECKS)}"
        )
    return EngineSettings(
        clamp_context=_flag(environ.get(CLAMP_CONTEXT_ENV)),
        require_tags=_flag(environ.get(REQUIRE_TAGS_ENV)),
        startup_gate="gate" not in disabled,
        prompt_guard="guard" not in disabled,
        coverage_check="coverage" not in disabled,
        page_check="pages" not in disabled,
    )
