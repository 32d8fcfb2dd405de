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


def new_generation_id() -> str:
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(_ULID_CHARS):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return PREFIX + "".join(reversed(chars))


def is_generation_id(text: str) -> bool:
    body = text[len(PREFIX):]
    return text.startswith(PREFIX) and len(body) == _ULID_CHARS and all(c in _CROCKFORD for c in body)


def bootstrap_room(generation_id: str) -> int:
    """The PD bootstrap room: the ID's low 63 bits, all of them random, so rooms don't collide."""
    value = 0
    for char in generation_id[len(PREFIX):]:
        value = (value << 5) | _CROCKFORD.index(char)
    return value & _ROOM_MASK


@functools.lru_cache(maxsize=65536)
def tenant_cache_salt(secret: str, tenant_id: str) -> str:
    """The tenant's SGLang ``extra_key`` (part of the radix-cache key): a keyed hash of the tenant,
    so prefix-cache entries never match across tenants and no client can choose or guess one."""
    return hmac.new(secret.encode(), tenant_id.encode(), hashlib.sha256).hexdigest()[:32]
