"""A (prefill, decode) worker pair: the unit that admission, routing and dispatch agree on.

A value type at the bottom of the import graph: the policy's two workers and the capacity
observation of each that a decision was made on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.config.policies import DecodeWorker, PrefillWorker
from gateway.workers.capacity import WorkerCapacity


@dataclass(frozen=True, slots=True)
class WorkerPair:
    pool: str
    prefill: PrefillWorker
    decode: DecodeWorker
    prefill_state: WorkerCapacity
    decode_state: WorkerCapacity

    # Made with the pair and read for every request, where the policy's own objects are
    # slower to read: the two workers' URLs (as claims are keyed), their ``/generate``
    # endpoints, and where decode reaches prefill's bootstrap server (host, port).
    urls: tuple[str, str] = field(init=False, compare=False, repr=False)
    generate_urls: tuple[str, str] = field(init=False, compare=False, repr=False)
    bootstrap: tuple[str | None, int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        prefill, decode = self.prefill, self.decode
        object.__setattr__(self, "urls", (prefill.url, decode.url))
        object.__setattr__(
            self, "generate_urls", (f"{prefill.url}/generate", f"{decode.url}/generate")
        )
        host = prefill.bootstrap_host or urlsplit(prefill.url).hostname
        object.__setattr__(self, "bootstrap", (host, prefill.bootstrap_port))
