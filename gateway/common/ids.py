"""Generation IDs: unique, time-sortable, minted by the gateway and never taken from a client.

A generation ID is a ULID (48-bit millisecond time + 80 random bits, Crockford base32) with a
``gen_`` prefix. It is SGLang's ``rid``, the OpenAI response ``id``, the audit key, and the
source of the PD ``bootstrap_room``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
PREFIX = "gen_"
_ULID_CHARS = 26
_ROOM_MASK = (1 << 63) - 1


# The time's ten digits two at a time (ten bits per lookup, five lookups), and each of the
# sixteen random digits from one random byte's low five bits (256 is a multiple of 32, so each
# digit is uniform): both by C calls (map, translate), not a loop of the interpreter per digit.
_DIGIT_PAIRS = tuple(first + second for first in _CROCKFORD for second in _CROCKFORD)
_TIME_SHIFTS = (40, 30, 20, 10, 0)
_LOW_TEN_BITS = (1023).__and__
_RANDOM_DIGITS = 16
_BYTE_TO_DIGIT = bytes(ord(_CROCKFORD[byte & 31]) for byte in range(256))
_TO_INT_DIGITS = str.maketrans(_CROCKFORD, "0123456789abcdefghijklmnopqrstuv")


def new_generation_id() -> str:
    millis = int(time.time() * 1000)
    stamp = "".join(
        map(_DIGIT_PAIRS.__getitem__, map(_LOW_TEN_BITS, map(millis.__rshift__, _TIME_SHIFTS)))
    )
    return PREFIX + stamp + os.urandom(_RANDOM_DIGITS).translate(_BYTE_TO_DIGIT).decode("ascii")


def is_generation_id(text: str) -> bool:
    body = text[len(PREFIX) :]
    return (
        text.startswith(PREFIX) and len(body) == _ULID_CHARS and all(c in _CROCKFORD for c in body)
    )


def bootstrap_room(generation_id: str) -> int:
    """The PD bootstrap room: the ID's low 63 bits, all of them random, so rooms don't collide."""
    return int(generation_id[len(PREFIX) :].translate(_TO_INT_DIGITS), 32) & _ROOM_MASK


@functools.lru_cache(maxsize=65536)
def tenant_cache_salt(secret: str, tenant_id: str) -> str:
    """The tenant's SGLang ``extra_key`` (part of the radix-cache key): a keyed hash of the tenant,
    so prefix-cache entries never match across tenants and no client can choose or guess one."""
    return hmac.new(secret.encode(), tenant_id.encode(), hashlib.sha256).hexdigest()[:32]
