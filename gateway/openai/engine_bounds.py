"""What each request field that reaches SGLang may hold: one table, applied by the protocol.

A bound here is what SGLang 0.5.23's own code accepts *and survives*: its ``SamplingParams``
normalisation and ``verify``, then the tensors ``SamplingBatchInfo.from_schedule_batch`` and
the penalizers build from the value. SGLang checks ranges in ``verify`` but not the dtypes of
the tensors built afterwards, so a value that passes ``verify`` and overflows an int32 tensor
does not fail the one request: it kills the scheduler, and with it every tenant's service.
Where OpenAI documents a narrower range the gateway keeps OpenAI's (never wider than SGLang's).

``tests/engine_bounds`` holds the table against SGLang itself (engine venv): each field's
smallest and largest accepted value goes through SGLang's normalisation and batch construction,
and one past either end is refused here. Bounds that only the model knows (a token id under its
vocabulary, ``min_tokens`` under ``max_tokens``, ``max_tokens`` under the model's policy) narrow
these per request (``_Request.check_against`` and the pipeline); the table keeps the type bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# SGLang's "the whole vocabulary" (``sampling_params.TOP_K_ALL``): the top_k that every request
# without one carries in the int32 top_k tensor, so the largest a client may ask for too.
TOP_K_ALL = 1 << 30
# SGLang's sampling epsilon (``sampling_params._SAMPLING_EPS``): a temperature below it is
# greedy decoding; the smallest value it treats as a factor of the logits.
SAMPLING_EPS = 1e-6


@dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    """A field's accepted range, inclusive unless ``low_open``, and why it is that range."""

    # SGLang's name for the field (a sampling parameter or a field of its generate request);
    # None where the gateway itself uses the value and SGLang never sees it.
    engine_name: str | None
    kind: type[int] | type[float]
    low: int | float
    high: int | float
    low_open: bool = False
    # Values outside [low, high] that SGLang gives a meaning (top_k -1: the whole vocabulary).
    sentinels: tuple[int, ...] = ()
    # How SGLang carries it: the dtype that sets the type bound.
    carried_as: str
    why: str

    def field(self) -> Any:
        """The pydantic ``Field`` of an optional request field under this bound (a sentinel
        below ``low`` widens it; the field's validator refuses what lies between)."""
        if self.sentinels:
            return Field(default=None, ge=min(self.low, *self.sentinels), le=self.high)
        if self.low_open:
            return Field(default=None, gt=self.low, le=self.high)
        return Field(default=None, ge=self.low, le=self.high)

    def item(self) -> Any:
        """The pydantic ``Field`` of one item of a list under this bound."""
        if self.low_open:
            return Field(gt=self.low, le=self.high)
        return Field(ge=self.low, le=self.high)

    def accepts(self, value: int | float) -> bool:
        if value in self.sentinels:
            return True
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def smallest(self) -> int | float:
        """The smallest value accepted (sentinels aside)."""
        if not self.low_open:
            return self.low
        return self.low + 1 if self.kind is int else math.nextafter(self.low, math.inf)

    def largest(self) -> int | float:
        return self.high

    def just_past(self) -> tuple[int | float, int | float]:
        """The nearest refused value on each side."""
        if self.kind is int:
            below = self.low if self.low_open else self.low - 1
            while below in self.sentinels:
                below -= 1
            return below, self.high + 1
        below = self.low if self.low_open else math.nextafter(self.low, -math.inf)
        return below, math.nextafter(self.high, math.inf)

    def describe(self) -> str:
        low = f"({self.low}" if self.low_open else f"[{self.low}"
        extra = "".join(f" or {value}" for value in self.sentinels)
        return f"{low}, {self.high}]{extra}"


_FLOAT32 = "float32 tensor (SamplingBatchInfo / penalizers)"
_TOKEN_ID = "int64 index into a [batch, vocabulary] tensor"

# Keyed by the field as the client names it. A token-id field's type bound is int32 (a
# vocabulary never reaches it); the model's vocabulary narrows it per request.
FIELD_BOUNDS: Mapping[str, Bound] = {
    "temperature": Bound(
        engine_name="temperature",
        kind=float,
        low=0.0,
        high=2.0,
        carried_as=_FLOAT32,
        why="OpenAI's range; SGLang takes any finite value >= 0 (0: greedy, top_k 1)",
    ),
    "top_p": Bound(
        engine_name="top_p",
        kind=float,
        low=0.0,
        low_open=True,
        high=1.0,
        carried_as=_FLOAT32,
        why="SGLang verify: (0, 1]",
    ),
    "top_k": Bound(
        engine_name="top_k",
        kind=int,
        low=1,
        high=TOP_K_ALL,
        sentinels=(-1,),
        carried_as="int32 tensor (SamplingBatchInfo.top_ks)",
        why="past int32 the scheduler dies building top_ks; SGLang's own 'all' is 2**30",
    ),
    "min_p": Bound(
        engine_name="min_p",
        kind=float,
        low=0.0,
        high=1.0,
        carried_as=_FLOAT32,
        why="SGLang verify: [0, 1]",
    ),
    "presence_penalty": Bound(
        engine_name="presence_penalty",
        kind=float,
        low=-2.0,
        high=2.0,
        carried_as=_FLOAT32,
        why="OpenAI's range, as SGLang verify",
    ),
    "frequency_penalty": Bound(
        engine_name="frequency_penalty",
        kind=float,
        low=-2.0,
        high=2.0,
        carried_as=_FLOAT32,
        why="OpenAI's range, as SGLang verify",
    ),
    "repetition_penalty": Bound(
        engine_name="repetition_penalty",
        kind=float,
        low=SAMPLING_EPS,
        high=2.0,
        carried_as=_FLOAT32,
        why=(
            "SGLang verify takes (0, 2], then divides a seen token's positive logit by it in "
            "float32: near 0 (0 in float32 from 1e-45 down) the logit is infinite, the "
            "probabilities NaN, and the sampler's multinomial kills the scheduler"
        ),
    ),
    "min_tokens": Bound(
        engine_name="min_new_tokens",
        kind=int,
        low=0,
        high=INT32_MAX,
        carried_as="int32 tensor (BatchedMinNewTokensPenalizer)",
        why="past int32 the scheduler dies preparing the penalizer; at most max_tokens",
    ),
    "max_tokens": Bound(
        engine_name="max_new_tokens",
        kind=int,
        low=1,
        high=INT32_MAX,
        carried_as="int, compared with int32 lengths",
        why="the type bound; the model's max_output_tokens narrows it",
    ),
    "max_completion_tokens": Bound(
        engine_name="max_new_tokens",
        kind=int,
        low=1,
        high=INT32_MAX,
        carried_as="int, compared with int32 lengths",
        why="the type bound; the model's max_output_tokens narrows it",
    ),
    "seed": Bound(
        engine_name="sampling_seed",
        kind=int,
        low=INT64_MIN,
        high=INT64_MAX,
        carried_as="int64 tensor (SamplingBatchInfo.sampling_seed, deterministic mode)",
        why="SGLang verify: int64",
    ),
    "stop_token_ids": Bound(
        engine_name="stop_token_ids",
        kind=int,
        low=0,
        high=INT32_MAX,
        carried_as=_TOKEN_ID,
        why="a token id: under the model's vocabulary",
    ),
    "logit_bias (token id)": Bound(
        engine_name="logit_bias",
        kind=int,
        low=0,
        high=INT32_MAX,
        carried_as=_TOKEN_ID,
        why="a token id: under the model's vocabulary; sent as a string of ASCII digits",
    ),
    "logit_bias (bias)": Bound(
        engine_name="logit_bias",
        kind=float,
        low=-100.0,
        high=100.0,
        carried_as="float32 tensor (SamplingBatchInfo.logit_bias)",
        why="OpenAI's range",
    ),
    "top_logprobs": Bound(
        engine_name="top_logprobs_num",
        kind=int,
        low=0,
        high=20,
        carried_as="int32 PD metadata buffer, 128 wide (MetadataBuffers)",
        why="OpenAI's range, under the PD transfer's width",
    ),
    "logprobs": Bound(  # completions: the number of alternatives per token
        engine_name="top_logprobs_num",
        kind=int,
        low=0,
        high=5,
        carried_as="int32 PD metadata buffer, 128 wide (MetadataBuffers)",
        why="OpenAI's range (completions), under the PD transfer's width",
    ),
    "n": Bound(
        engine_name=None,
        kind=int,
        low=1,
        high=16,
        carried_as="the gateway's fan-out: n separate engine requests",
        why="one request may not fan out without end",
    ),
    "length_penalty": Bound(  # vLLM's; accepted and ignored (protocol: Ignored)
        engine_name=None,
        kind=float,
        low=-100.0,
        high=100.0,
        carried_as="nowhere: it weighs beam search's candidates, and there is no beam search",
        why="a finite weight, as beam search would read it; it reaches no engine",
    ),
    "best_of": Bound(
        engine_name=None,
        kind=int,
        low=1,
        high=16,
        carried_as="the gateway's fan-out: best_of separate engine requests",
        why="one request may not fan out without end",
    ),
}

# A logit_bias key is a token id written in ASCII digits: ``str.isdigit`` also takes "²" and
# "٣" (which ``int`` refuses, or reads as 3), and an int32 has at most 10 digits.
LOGIT_BIAS_KEY = "[0-9]{1,10}"  # the whole key (re.fullmatch)
