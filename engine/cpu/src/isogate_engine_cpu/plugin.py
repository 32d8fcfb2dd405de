"""SGLang general plugin `isogate_cpu` (CPU-ONLY, development): the pinned-memory workaround,
and forked server children where asked for (`fork_workers`).

On prefill, `disaggregation/prefill.py` pins a host copy of the KV indices when the sender
says `supports_host_tensor_indices`; pinning needs CUDA, so on the CPU it raises
`pin_memory=True requires a CUDA or other accelerator backend`. Turning the capability off
makes the Mooncake sender take the plain-tensor path.
"""

import logging

import torch

from isogate_engine_cpu import fork_workers

logger = logging.getLogger(__name__)


class CpuShimOnAcceleratorError(RuntimeError):
    """The CPU-only shims were loaded in a process that sees a GPU."""


def register() -> None:
    if torch.cuda.is_available():
        # SGLang logs a plugin's exception and carries on: the message must say it all.
        raise CpuShimOnAcceleratorError(
            "isogate-engine-cpu (CPU-only dev shims) is installed in an environment with a "
            "GPU; refusing to disable MooncakeKVSender.supports_host_tensor_indices. "
            "Uninstall isogate-engine-cpu: it also shadows the real sgl_kernel."
        )
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    MooncakeKVSender.supports_host_tensor_indices = False
    logger.info("isogate_cpu: MooncakeKVSender.supports_host_tensor_indices = False (CPU dev)")
    if fork_workers.wanted():
        fork_workers.install()
