"""isogate's SGLang plugin: tenant isolation checks inside the engine.

Loaded by SGLang from the ``sglang.srt.plugins`` entry point ``isogate``
(``engine_patch:register``) in every SGLang process. It carries the gateway's
isolation tags to the Req and back, attests and verifies KV coverage between
prefill and decode, tags pages with the generation that wrote them, and refuses
workers and prompts whose size the KV pool cannot hold. See engine_patch/README.md.

Nothing here is imported by the gateway: this package needs torch and sglang.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("isogate.engine")


class PluginRefusedToLoad(SystemExit):
    """Stops the SGLang process: ``load_plugins`` swallows ``Exception``, not ``SystemExit``."""


def register() -> None:
    from engine_patch.compat import compatibility_problems
    from engine_patch.events import LOG_PREFIX
    from engine_patch.hooks import install_hooks
    from engine_patch.settings import load_settings

    problems = compatibility_problems()
    if problems:
        message = f"{LOG_PREFIX} refusing to load on this SGLang: " + "; ".join(problems)
        logger.critical(message)
        raise PluginRefusedToLoad(message)
    settings = load_settings()
    install_hooks(settings)
    if settings.disabled_checks:
        logger.warning(
            "%s checks DISABLED by configuration: %s (never in production)",
            LOG_PREFIX,
            settings.disabled_checks,
        )
    logger.info("%s loaded with %s", LOG_PREFIX, settings)
