"""SGLang's scheduler and detokenizer forked, not spawned (CPU-ONLY, development and tests).

SGLang starts each server's scheduler and detokenizer with multiprocessing's ``spawn``
(``_set_envs_and_config`` forces it): a CUDA context cannot survive a fork. A spawned child
starts a fresh interpreter and imports torch, transformers and SGLang again, which on the
CPU is most of a server's start: three interpreters import the same stack. On the CPU there
is no CUDA context to lose, and a forked child inherits the server process's imports, and
the hooks SGLang's plugins applied there (``load_plugins`` runs in the server process before
its children start, and is idempotent in them).

Switched on per server by ``ISOGATE_CPU_FORK_WORKERS=1`` (``gateway.dev.cluster`` sets it
unless a cluster asks for SGLang's own ``spawn``); refused where a GPU is visible.
"""

import logging
import multiprocessing
import os

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)

FORK_WORKERS_ENV = "ISOGATE_CPU_FORK_WORKERS"
# Where SGLang 0.5.23 sets the start method for the processes of one server.
SET_ENVS_AND_CONFIG = "sglang.srt.entrypoints.engine._set_envs_and_config"


def wanted() -> bool:
    return os.environ.get(FORK_WORKERS_ENV) == "1"


def fork_after_sglang_chose_spawn(result: object, *args: object, **kwargs: object) -> None:
    """After ``_set_envs_and_config`` forced ``spawn``: ``fork`` for the children it starts."""
    multiprocessing.set_start_method("fork", force=True)
    logger.info("isogate_cpu: scheduler and detokenizer forked, not spawned (CPU dev)")


def install() -> None:
    HookRegistry.register(SET_ENVS_AND_CONFIG, fork_after_sglang_chose_spawn, HookType.AFTER)
