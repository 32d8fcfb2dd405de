"""Key revocations and tenant changes reach every replica's key cache through Redis pub/sub.

The problem: each replica caches key lookups (``gateway.tenancy.auth``) for ``auth_cache_ttl_s``; a
key revoked through one replica kept working on the others until their entries expired. Here
the replica that made the change forgets it at once and publishes it on one Redis channel;
every replica subscribes and forgets what it is told, so a revocation reaches all of them as
fast as Redis delivers a message. The TTL stays as the bound when Redis is away: a message
published while a replica was not subscribed is lost, so on every (re)subscription the
replica expires its whole cache rather than trust entries that may have missed one (expired,
not dropped: while the key store is down, recently valid keys still serve from it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import Counter

from gateway.tenancy.auth import Authenticator

log = logging.getLogger("isogate.auth")

_RESUBSCRIBE_S = 1.0


class Revocations:
    """Forget a key or tenant here and publish it to the other replicas (``run`` listens)."""

    def __init__(
        self,
        authenticator: Authenticator,
        redis: Any | None,  # redis.asyncio.Redis; its replies are typed Awaitable | Any
        key_prefix: str,
        received: Counter,
    ) -> None:
        self._authenticator = authenticator
        self._redis = redis
        self._channel = f"{key_prefix}:auth:forget"
        self._received = received

    async def key_revoked(self, key_id: str) -> None:
        self._authenticator.forget_key(key_id)
        await self._publish(f"key:{key_id}")

    async def tenant_changed(self, tenant_id: str) -> None:
        self._authenticator.forget_tenant(tenant_id)
        await self._publish(f"tenant:{tenant_id}")

    async def _publish(self, message: str) -> None:
        if self._redis is None:
            return
        try:
            await self._redis.publish(self._channel, message)
        except Exception as exc:  # the others fall back on their cache TTL
            log.warning("auth: could not publish %s to other replicas: %s", message, exc)

    def apply(self, message: str) -> None:
        kind, _, name = message.partition(":")
        if kind == "key":
            self._authenticator.forget_key(name)
        elif kind == "tenant":
            self._authenticator.forget_tenant(name)
        else:
            log.warning("auth: ignored an unknown invalidation %r", message[:100])
            return
        self._received.labels(kind).inc()

    async def run(self) -> None:
        """Listen until cancelled; resubscribe after any Redis failure."""
        if self._redis is None:
            return
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(self._channel)
                    # Whatever was published while unsubscribed is lost: ask the store again.
                    self._authenticator.expire_all()
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            data = message["data"]
                            self.apply(data.decode() if isinstance(data, bytes) else str(data))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("auth: invalidation channel lost (%s); resubscribing", exc)
            await asyncio.sleep(_RESUBSCRIBE_S)
