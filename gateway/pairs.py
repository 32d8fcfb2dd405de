"""A (prefill, decode) worker pair: the unit that admission, routing and dispatch agree on.

A value type at the bottom of the import graph: the policy's two workers and the capacity
observation of each that a decision was made on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .capacity import WorkerCapacity
from .policies import DecodeWorker, PrefillWorker


@dataclass(frozen=True, slots=True)
class WorkerPair:
    pool: str
    prefill: PrefillWorker
    decode: DecodeWorker
    prefill_state: WorkerCapacity
    decode_state: WorkerCapacity

    # The two workers' URLs, as claims are keyed: made with the pair, read for every request.
    urls: tuple[str, str] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", (self.prefill.url, self.decode.url))
