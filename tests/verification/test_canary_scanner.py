"""The canary scanner and the stream guard, in-process: markers are found wherever chunks split
them."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.verification.scanner import (
    MARKER_LENGTH,
    MARKER_PREFIX,
    CanaryHit,
    CanaryScanner,
    new_marker,
)
from gateway.verification.verify import (
    IncrementalChunks,
    IsolationFailure,
    StreamGuard,
    check_text,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def scanner_with(
    marker: str, owner: str, ttl_s: float = 60.0
) -> tuple[CanaryScanner, list[CanaryHit]]:
    hits: list[CanaryHit] = []
    scanner = CanaryScanner(on_hit=hits.append)
    await scanner.register_marker(marker, owner, ttl_s, origin="test")
    return scanner, hits


async def test_another_tenants_marker_is_found_and_reported() -> None:
    marker = new_marker()
    scanner, hits = await scanner_with(marker, "tenant-b")
    assert scanner.foreign_marker(f"some output {marker} more", "tenant-a") == marker
    assert hits == [CanaryHit(marker, "tenant-b", "test", "tenant-a")]
    with pytest.raises(IsolationFailure, match="canary"):
        check_text(scanner, f"x{marker}", "tenant-a")


async def test_a_tenants_own_marker_and_unknown_markers_pass() -> None:
    marker = new_marker()
    scanner, hits = await scanner_with(marker, "tenant-a")
    assert scanner.foreign_marker(f"echo {marker}", "tenant-a") is None
    assert scanner.foreign_marker(f"echo {new_marker()} {MARKER_PREFIX}", "tenant-b") is None
    assert (
        scanner.foreign_marker(f"echo {marker}", "tenant-b") == marker
    )  # the same text, another reader
    assert len(hits) == 1


async def test_expired_markers_are_not_live() -> None:
    marker = new_marker()
    scanner, _ = await scanner_with(marker, "tenant-b", ttl_s=0.0001)
    await asyncio.sleep(0.01)
    assert scanner.foreign_marker(marker, "tenant-a") is None
    await scanner.refresh()
    assert scanner.live_count == 0


async def test_only_well_formed_markers_can_be_registered() -> None:
    scanner = CanaryScanner()
    for bad in ("secret", MARKER_PREFIX + "x" * 5, new_marker()[:-1] + "]", new_marker().upper()):
        with pytest.raises(ValueError):
            await scanner.register_marker(bad, "tenant-b", 60)


async def test_a_marker_split_across_two_chunks_is_caught_before_any_of_it_is_sent() -> None:
    marker = new_marker()
    scanner, _ = await scanner_with(marker, "tenant-b")
    guard = StreamGuard(scanner, "tenant-a")
    sent = guard.feed("Hello, " + marker[:9])
    with pytest.raises(IsolationFailure):
        guard.feed(marker[9:] + " tail")
    assert MARKER_PREFIX[0] not in sent and sent == "Hello, "[: len(sent)]


@settings(max_examples=200, deadline=None)
@given(
    before=st.text(max_size=60),
    after=st.text(max_size=60),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_no_byte_of_a_foreign_marker_is_ever_sent_whatever_the_chunking(
    before: str, after: str, cuts: list[int]
) -> None:
    marker = new_marker()
    scanner = CanaryScanner()
    asyncio.run(scanner.register_marker(marker, "tenant-b", 60))
    text = before + marker + after
    ends = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    guard = StreamGuard(scanner, "tenant-a")
    sent, fed = "", 0
    with pytest.raises(IsolationFailure):
        for end in ends:
            sent += guard.feed(text[fed:end])
            fed = end
        sent += guard.finish()
    # Nothing from the marker's first character on reached the client.
    assert len(sent) <= len(before) and text.startswith(sent)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=10))
def test_clean_text_comes_through_whole_and_in_order(text: str, cuts: list[int]) -> None:
    scanner = CanaryScanner()
    asyncio.run(scanner.register_marker(new_marker(), "tenant-b", 60))
    guard = StreamGuard(scanner, "tenant-a")
    sent, fed = "", 0
    for end in sorted({min(c, len(text)) for c in cuts}):
        sent += guard.feed(text[fed:end])
        fed = end
        assert fed - len(sent) <= MARKER_LENGTH - 1  # held back no more than needed
    sent += guard.feed(text[fed:])
    sent += guard.finish()
    assert sent == text


def test_rewritten_stream_text_is_refused() -> None:
    # An engine that repeats its output in every chunk must repeat it unchanged.
    chunks = IncrementalChunks(repeats_output=True)
    assert chunks.new_part({"text": "Hello world"})["text"] == "Hello world"
    assert chunks.new_part({"text": "Hello world, more"})["text"] == ", more"
    with pytest.raises(IsolationFailure, match="rewritten"):
        chunks.new_part({"text": "Hellx world, more and more"})


@pytest.mark.redis
async def test_markers_are_shared_between_replicas_through_redis() -> None:
    import redis.asyncio as redis_asyncio

    from tests.conftest import REDIS_URL

    client = redis_asyncio.from_url(REDIS_URL)
    key = "isogate-test-canary-" + secrets.token_hex(6)
    try:
        publisher, reader = CanaryScanner(client, key), CanaryScanner(client, key)
        marker = new_marker()
        await publisher.register_marker(marker, "tenant-b", 30, origin="replica-1")
        assert reader.foreign_marker(marker, "tenant-a") is None  # not until its next refresh
        await reader.refresh()
        assert reader.foreign_marker(marker, "tenant-a") == marker
        assert reader.foreign_marker(marker, "tenant-b") is None
        assert 0 < await client.pttl(key) <= 90_000
        # Expired markers are pruned from the shared hash by whichever replica sees them first.
        stale = new_marker()
        await publisher.register_marker(stale, "tenant-b", 0.001)
        await asyncio.sleep(0.01)
        await reader.refresh()
        assert (
            await client.hexists(key, stale) == 0
            and reader.foreign_marker(stale, "tenant-a") is None
        )
    finally:
        await client.delete(key)
        await client.aclose()
