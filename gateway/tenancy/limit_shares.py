"""What one gateway process holds of each limit shared through Redis, spent without asking Redis.

The problem: with Redis, every request used to take its count, its concurrency slot and its
tokens in a round trip of its own, and give the slot back in another: a process paid Redis
four times a request, in latency and in CPU, whatever the limits were.

The invariant: a share is taken from the Redis bucket (requests, tokens) or recorded in the
Redis set of slots in flight before any of it is spent, so every process's requests together
never take more than one Redis round trip per request would have let them. A share is topped
up to its *spare* (``spare_of``: a fraction of the limit) past what the request that ran
short needs; what requests give back (a settle's unused tokens, a released slot) stays in it
up to twice the spare, and past that goes back to Redis at once, down to the spare (so that a
steady stream of requests does not send a give-back each); everything a share did not spend
for a whole heartbeat goes back too.

The cost, and its bound: a process that holds spare keeps it from the others, so a tenant at
its limit may be refused up to twice a spare per other process early, for at most a
heartbeat (a share given back at a settle or a release keeps one spare until then);
the ``x-ratelimit-remaining-*`` headers count the bucket as Redis last reported it plus this
process's share. A limit too small to have a spare (the default fraction of 60 requests a
minute is none) is taken and given back in Redis request by request, exactly as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.config.policies import TenantLimits

# Slots are members of a Redis set each: a share of a huge concurrency limit would otherwise
# be thousands of members added at a time.
MOST_SPARE_SLOTS = 64


@dataclass(frozen=True, slots=True)
class Spare:
    """The most of each resource a share may hold unspent."""

    requests: int
    tokens: int
    slots: int


def spare_of(limits: TenantLimits, fraction: float) -> Spare:
    return Spare(
        math.floor(limits.requests_per_minute * fraction),
        math.floor(limits.tokens_per_minute * fraction),
        min(MOST_SPARE_SLOTS, math.floor(limits.max_concurrent * fraction)),
    )


@dataclass(slots=True)
class Share:
    """This process's holding of one scope's limits (``LimitScope.key``)."""

    # The scope's limits as of its last take (a policy reload applies from the next one).
    limits: TenantLimits
    requests: int = 0
    tokens: int = 0
    # Slot members this process holds in the scope's Redis set: free ones, and those a request
    # of this process holds.
    free_slots: list[str] = field(default_factory=list)
    busy_slots: set[str] = field(default_factory=set)
    # The bucket as Redis last reported it (for the rate-limit headers).
    bucket_requests: int = 0
    bucket_tokens: int = 0
    # Spent from since the last heartbeat: a share that was not gives everything back.
    spent: bool = False

    def empty(self) -> bool:
        return not (self.requests or self.tokens or self.free_slots or self.busy_slots)


@dataclass(slots=True)
class Taking:
    """What one take got from one scope's share, and what it lacks and asks Redis for."""

    share: Share
    requests: int
    tokens: int
    slot: str | None
    lack_requests: int
    lack_tokens: int
    lack_slot: int

    def lacks(self) -> bool:
        return bool(self.lack_requests or self.lack_tokens or self.lack_slot)

    def got(
        self, bucket_requests: int, bucket_tokens: int, requests: int, tokens: int, slots: list[str]
    ) -> None:
        """Redis granted the lack and a spare: the lack is spent at once, the rest is the
        share's; what Redis said its bucket has left is kept for the headers."""
        share = self.share
        share.bucket_requests, share.bucket_tokens = bucket_requests, bucket_tokens
        share.requests += requests - self.lack_requests
        share.tokens += tokens - self.lack_tokens
        self.requests += self.lack_requests
        self.tokens += self.lack_tokens
        if self.lack_slot:
            self.slot = slots[0]
            share.busy_slots.add(slots[0])
            share.free_slots.extend(slots[1:])
        self.lack_requests = self.lack_tokens = self.lack_slot = 0

    def undo(self) -> None:
        """Put back what was taken from the share (the take failed as a whole)."""
        share = self.share
        share.requests += self.requests
        share.tokens += self.tokens
        if self.slot is not None:
            share.busy_slots.discard(self.slot)
            share.free_slots.append(self.slot)


def least_and_most(lack: int, spare: int) -> tuple[int, int]:
    """What a top-up asks Redis for of one resource: at least the lack, at most the lack and a
    spare; nothing when nothing lacks (a share is topped up only where it ran short)."""
    return lack, lack + spare if lack else 0


def take_from(share: Share, requests: int, tokens: int, slot: bool) -> Taking:
    """Take what ``share`` has of a request's need; the rest is its lack, asked of Redis."""
    got_requests = min(requests, share.requests)
    got_tokens = min(tokens, max(0, share.tokens))
    share.requests -= got_requests
    share.tokens -= got_tokens
    member = None
    if slot and share.free_slots:
        member = share.free_slots.pop()
        share.busy_slots.add(member)
    share.spent = True
    return Taking(
        share,
        got_requests,
        got_tokens,
        member,
        requests - got_requests,
        tokens - got_tokens,
        int(slot and member is None),
    )


def over_spare(share: Share, spare: Spare) -> tuple[int, int, list[str]]:
    """Where ``share`` holds more than twice ``spare`` of a resource, what it holds past the
    spare (requests, tokens, free slots), taken out of it to go back to Redis; tokens below
    zero (a settle's overshoot) are owed: returned negative."""
    requests = share.requests - spare.requests if share.requests > 2 * spare.requests else 0
    tokens = share.tokens - spare.tokens if share.tokens > 2 * spare.tokens else 0
    if share.tokens < 0:
        tokens = share.tokens
    share.requests -= requests
    share.tokens -= tokens
    slots: list[str] = []
    if len(share.free_slots) > 2 * spare.slots:
        while len(share.free_slots) > spare.slots:
            slots.append(share.free_slots.pop())
    return requests, tokens, slots


def all_unspent(share: Share) -> tuple[int, int, list[str]]:
    """Everything ``share`` holds unspent, taken out of it to go back to Redis."""
    returned = share.requests, share.tokens, share.free_slots
    share.requests = share.tokens = 0
    share.free_slots = []
    return returned
