"""CPU-ONLY STAND-IN for SGLang's `sgl_kernel` (isogate-engine-cpu, development only).

No CPU build of sgl-kernel exists on PyPI, and SGLang's CPU path imports it. A tiny Llama
served with `--attention-backend torch_native` calls exactly one kernel,
`assign_req_to_token_pool_cpu`, written here in plain torch. Every other name resolves to a
callable that raises when called, so an unexpected kernel use fails loudly instead of
computing something wrong. Never install this next to the real sgl-kernel on a GPU host.
"""

from collections.abc import Callable
from typing import NoReturn

import torch

IS_ISOGATE_CPU_STAND_IN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request i, write its slice of `out_cache_loc` into `req_to_token[pool_i, s:e]`.

    `out_cache_loc` holds the new cache locations of all requests back to back, in request
    order (the same layout the Triton kernel `assign_req_to_token_pool` reads).
    """
    del pool_len  # the row length is req_to_token.shape[1]; kept for the kernel's signature
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    consumed = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[consumed : consumed + count].to(
            req_to_token.dtype
        )
        consumed += count


def _not_on_cpu(name: str) -> Callable[..., NoReturn]:
    def kernel_missing_from_cpu_stand_in(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by the isogate CPU stand-in "
            "(isogate-engine-cpu); only assign_req_to_token_pool_cpu is."
        )

    kernel_missing_from_cpu_stand_in.__name__ = name
    return kernel_missing_from_cpu_stand_in


def __getattr__(name: str) -> Callable[..., NoReturn]:
    # Module-level imports like `from sgl_kernel import x` must succeed; only a call fails.
    if name.startswith("__"):
        raise AttributeError(name)
    return _not_on_cpu(name)
