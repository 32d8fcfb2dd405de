"""Stable 63-bit fingerprints of a generation and of a tenant.

They travel in uint64 metadata slots and in int64 page-owner tensors, so they
stay below 2**63 and are never 0 (0 means "nothing written").
"""

from __future__ import annotations

import hashlib
from typing import Any

_MASK_63 = (1 << 63) - 1


def _fingerprint(value: str, person: bytes) -> int:
    digest = hashlib.blake2b(value.encode(), digest_size=8, person=person).digest()
    return (int.from_bytes(digest, "little") & _MASK_63) | 1


def generation_fingerprint(generation: str) -> int:
    return _fingerprint(generation, b"isogate-gen")


def tenant_fingerprint(tenant: str) -> int:
    return _fingerprint(tenant, b"isogate-tenant")


def generation_of(req: Any) -> str:
    """The generation a request belongs to: its tag, else its PD bootstrap room, else its rid.

    The tokenizer-side check makes a tagged request's rid equal its generation tag, so
    both sides of a PD pair derive the same value. An untagged request (e.g. sent through
    sglang_router, which mints a separate rid on each side) shares only its bootstrap room
    between prefill and decode, so that is its identity."""
    tagged: str | None = getattr(req, "isolation_generation", None)
    if tagged:
        return tagged
    room = getattr(req, "bootstrap_room", None)
    return f"room:{room}" if room is not None else req.rid


def tenant_of(req: Any) -> str:
    """The tenant a request belongs to: its tag, else its cache salt (extra_key)."""
    return getattr(req, "isolation_tenant", None) or (req.extra_key or "")


def req_fingerprints(req: Any) -> tuple[int, int]:
    """(generation, tenant) fingerprints, computed once per request."""
    cached = getattr(req, "isogate_fingerprints", None)
    if cached is None:
        cached = (
            generation_fingerprint(generation_of(req)),
            tenant_fingerprint(tenant_of(req)),
        )
        req.isogate_fingerprints = cached
    return cached
