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
# Comma-separated subset of {"coverage", "pages"}. Only for proving that each
# layer catches a short transfer on its own; a production worker leaves it unset.
DISABLE_CHECKS_ENV = "ISOGATE_ENGINE_DISABLE_CHECKS"

_KNOWN_CHECKS = frozenset({"coverage", "pages"})


@dataclass(frozen=True)
class EngineSettings:
    clamp_context: bool = False
    require_tags: bool = False
    coverage_check: bool = True
    page_check: bool = True


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def load_settings(environ: Mapping[str, str] = os.environ) -> EngineSettings:
    disabled = {
        name.strip()
        for name in environ.get(DISABLE_CHECKS_ENV, "").split(",")
        if name.strip()
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
        coverage_check="coverage" not in disabled,
        page_check="pages" not in disabled,
    )
