"""Generation IDs and bootstrap rooms, checked against a plain digit-by-digit reference."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.common import ids

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def reference_encode(value: int) -> str:
    chars = []
    for _ in range(26):
        chars.append(CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def reference_room(generation_id: str) -> int:
    value = 0
    for char in generation_id[len("gen_") :]:
        value = (value << 5) | CROCKFORD.index(char)
    return value & ((1 << 63) - 1)


# No deadline: a check of the encoding, not of its speed (the first example, on a loaded host,
# once took longer than hypothesis's default 200 ms).
@settings(deadline=None)
@given(st.integers(min_value=0, max_value=(1 << 128) - 1))
def test_the_encoding_is_the_ulid_base32_of_the_value(value: int) -> None:
    generation_id = "gen_" + reference_encode(value)
    assert ids.is_generation_id(generation_id)
    assert (
        ids.bootstrap_room(generation_id)
        == reference_room(generation_id)
        == value & ((1 << 63) - 1)
    )


def test_new_ids_decode_to_their_time_and_sort_by_it(monkeypatch) -> None:
    now_ms = int(time.time() * 1000)
    made = [ids.new_generation_id() for _ in range(200)]
    for generation_id in made:
        assert ids.is_generation_id(generation_id), generation_id
        value = int(
            generation_id[4:].translate(
                str.maketrans(CROCKFORD, "0123456789abcdefghijklmnopqrstuv")
            ),
            32,
        )
        assert reference_encode(value) == generation_id[4:]
        assert abs((value >> 80) - now_ms) < 60_000
        assert ids.bootstrap_room(generation_id) == reference_room(generation_id)
    monkeypatch.setattr(ids.time, "time", lambda: time.time_ns() / 1e9 + 10)  # ten seconds later
    assert ids.new_generation_id() > max(made)
    assert len(set(made)) == len(made)


@settings(deadline=None)
@given(st.integers(min_value=0, max_value=(1 << 48) - 1), st.binary(min_size=16, max_size=16))
def test_a_new_id_is_the_reference_encoding_of_its_time_and_random_bits(
    millis: int, random: bytes
) -> None:
    # Each of the 16 random digits is one random byte's low five bits: 80 random bits.
    random_bits = 0
    for byte in random:
        random_bits = (random_bits << 5) | (byte & 31)
    real_time, real_urandom = ids.time.time, ids.os.urandom
    ids.time.time, ids.os.urandom = (lambda: millis / 1000 + 0.0004), (lambda size: random)
    try:
        generation_id = ids.new_generation_id()
    finally:
        ids.time.time, ids.os.urandom = real_time, real_urandom
    assert generation_id == "gen_" + reference_encode((millis << 80) | random_bits)
