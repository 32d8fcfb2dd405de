"""Gates 2-4 as seen from outside the engine: nothing reaches a client before it is checked.

An HTTP 200 and "transfer complete" prove nothing about whose KV pages decode read. What the
gateway can prove from outside is that the engine answered *this* request: it echoes the
generation and tenant IDs that ``engine_patch`` carried through prefill and decode, it counted
exactly the prompt the gateway tokenized, and it generated no more than was asked. Any
mismatch fails the request closed (HTTP 502 ``isolation_check_failed``; for a stream, an error
event and nothing more), never a 200.

Canary scanning (``scanner``) adds the content check: no output carries a live marker
of another tenant. Streamed text is held back by the longest marker's length minus one, so a
marker split across chunks is caught before any byte of it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gateway.common.errors import APIError, isolation_check_failed

# The reason of a canary hit; the pipeline can tell it from the other checks' reasons by it.
FOREIGN_MARKER_REASON = "output carries another tenant's canary marker"


class IsolationFailure(Exception):
    """The engine's answer does not belong to the request; ``reason`` says which check failed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def api_error(self) -> APIError:
        return isolation_check_failed(
            f"The response failed an isolation check and was withheld ({self.reason})."
        )


@dataclass(slots=True)
class Expectation:
    generation_id: str
    tenant_id: str
    prompt_tokens: int
    max_tokens: int
    require_tags: bool
    # With log probabilities: this many alternatives per token, ids below ``vocab_size``.
    top_logprobs: int | None = None
    vocab_size: int = 0


def check_meta(
    meta: Any,
    expected: Expectation,
    tokens_before: int = 0,
    *,
    entries: bool = True,
    output: bool = True,
) -> None:
    """Check one engine response (or stream chunk) ``meta_info`` against the request; a stream
    chunk's log probabilities are those of the tokens after the ``tokens_before`` earlier ones
    (``IncrementalChunks``). Without ``entries``, the log probabilities' shape only: their
    entries are the caller's to check (``check_logprob_entries``), a slice at a time. Without
    ``output`` (a chunk that ends its generation with an abort before any output:
    ``refused_before_output``), decode's coverage report and its count of the prompt guard
    nothing, and are not read: a refusal's counts are whatever stage refused it."""
    if not isinstance(meta, dict):
        raise IsolationFailure("response carries no meta_info")
    if meta.get("id") != expected.generation_id:
        raise IsolationFailure("meta_info.id is not this request's generation ID")
    if expected.require_tags:
        if meta.get("isolation_generation") != expected.generation_id:
            raise IsolationFailure(
                "engine echoed another generation ID"
                if "isolation_generation" in meta
                else "engine did not echo the generation ID"
            )
        if meta.get("isolation_tenant") != expected.tenant_id:
            raise IsolationFailure(
                "engine echoed another tenant"
                if "isolation_tenant" in meta
                else "engine did not echo the tenant"
            )
        # engine_patch's decode says whether it verified that prefill's transfer covered every
        # page it reserved (gate 3). An explicit "not verified" is a failure; an engine that
        # does not report it at all is judged by the tags alone.
        if output and "isolation_verified" in meta and meta["isolation_verified"] is not True:
            raise IsolationFailure("decode did not verify the KV transfer's coverage")
    prompt_tokens = meta.get("prompt_tokens")
    if output and prompt_tokens != expected.prompt_tokens:
        raise IsolationFailure(
            f"engine counted {prompt_tokens} prompt tokens, "
            f"the gateway sent {expected.prompt_tokens}"
        )
    completion_tokens = meta.get("completion_tokens", 0)
    if not isinstance(completion_tokens, int) or not 0 <= completion_tokens <= expected.max_tokens:
        raise IsolationFailure(
            f"completion_tokens {completion_tokens} outside 0..{expected.max_tokens}"
        )
    cached_tokens = meta.get("cached_tokens", 0)
    if not isinstance(cached_tokens, int) or not 0 <= cached_tokens <= expected.prompt_tokens:
        raise IsolationFailure(f"cached_tokens {cached_tokens} outside 0..{expected.prompt_tokens}")
    if expected.top_logprobs is not None:
        new_tokens = completion_tokens - tokens_before
        check_logprobs_shape(meta, new_tokens, expected)
        if entries:
            check_logprob_entries(meta, expected, range(new_tokens))


def check_logprobs_shape(meta: dict[str, Any], new_tokens: int, expected: Expectation) -> None:
    """One log-probability entry per new completion token (all of them in a whole answer, a
    chunk's own in a stream), with as many alternatives; none for the prompt, which was not
    asked for."""
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != new_tokens:
        count = len(entries) if isinstance(entries, list) else "no"
        raise IsolationFailure(f"{count} log-probability entries for {new_tokens} new tokens")
    if meta.get("input_token_logprobs"):
        raise IsolationFailure("prompt log probabilities that were not asked for")
    if expected.top_logprobs:
        alternatives = meta.get("output_top_logprobs")
        if not isinstance(alternatives, list) or len(alternatives) != new_tokens:
            raise IsolationFailure("top log probabilities do not match the completion tokens")


def check_logprob_entries(meta: dict[str, Any], expected: Expectation, positions: range) -> None:
    """The entries at ``positions`` (of a ``meta`` whose shape was checked): each a token id
    inside the vocabulary with a log probability, with exactly the alternatives asked for."""
    entries = meta["output_token_logprobs"]
    top = expected.top_logprobs or 0
    alternatives = meta.get("output_top_logprobs") if top else None
    for position in positions:
        _check_logprob_entry(entries[position], expected.vocab_size)
        if alternatives is None:
            continue
        listed = alternatives[position]
        if not isinstance(listed, list) or len(listed) != min(top, expected.vocab_size):
            raise IsolationFailure("a token's top log probabilities are not as asked for")
        for entry in listed:
            _check_logprob_entry(entry, expected.vocab_size)


def check_prompt_logprobs(
    meta: Any, input_ids: list[int], expected: Expectation, positions: range | None = None
) -> None:
    """Prefill's scores of the prompt (``echo``), from prefill's answer to this generation:
    one entry per prompt token, for exactly the prompt's tokens in order (the first,
    conditioned on nothing, without a log probability), each with the alternatives asked for.
    Anything else scored another sequence. With ``positions``, the entries of those only (the
    shape is checked at every call), so that a long prompt can be checked a slice at a time."""
    if not isinstance(meta, dict) or meta.get("id") != expected.generation_id:
        raise IsolationFailure("prefill's prompt scores are not this request's")
    vocab_size, top_logprobs = expected.vocab_size, expected.top_logprobs or 0
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(input_ids):
        count = len(entries) if isinstance(entries, list) else "no"
        raise IsolationFailure(
            f"{count} prompt log-probability entries for {len(input_ids)} prompt tokens"
        )
    alternatives = meta.get("input_top_logprobs")
    if top_logprobs and (not isinstance(alternatives, list) or len(alternatives) != len(input_ids)):
        raise IsolationFailure("top log probabilities do not match the prompt tokens")
    for position in range(len(input_ids)) if positions is None else positions:
        entry = entries[position]
        if not isinstance(entry, list) or len(entry) < 2 or entry[1] != input_ids[position]:
            raise IsolationFailure("prompt log probabilities of tokens that are not the prompt's")
        if not position:
            continue
        _check_logprob_entry(entry, vocab_size)
        if top_logprobs:
            assert isinstance(alternatives, list)  # checked above
            top = alternatives[position]
            if not isinstance(top, list) or len(top) != min(top_logprobs, vocab_size):
                raise IsolationFailure(
                    "a prompt token's top log probabilities are not as asked for"
                )
            for alternative in top:
                _check_logprob_entry(alternative, vocab_size)


def _check_logprob_entry(entry: Any, vocab_size: int) -> None:
    # SGLang's entry: [logprob, token id, text or None].
    if not isinstance(entry, list) or len(entry) < 2:
        raise IsolationFailure("a log-probability entry is malformed")
    logprob, token = entry[0], entry[1]
    if not isinstance(token, int) or not 0 <= token < vocab_size:
        raise IsolationFailure(f"log-probability token id {token!r} outside the vocabulary")
    if not isinstance(logprob, (int, float)) or logprob > 0:
        raise IsolationFailure(f"log probability {logprob!r} is not a log probability")


class ContentScanner(Protocol):
    """Finds another tenant's live canary marker in output text (see ``scanner``)."""

    @property
    def holdback_chars(self) -> int: ...

    @property
    def marker_start(self) -> str: ...  # the character every marker begins with

    def foreign_marker(self, text: str, tenant_id: str) -> str | None: ...


class NoScanner:
    holdback_chars = 0
    marker_start = ""

    def foreign_marker(self, text: str, tenant_id: str) -> str | None:
        return None


class StreamGuard:
    """Turns the engine's stream text, fed a chunk's new text at a time, into checked deltas for
    the client.

    ``feed`` returns the part that is safe to send now: the new text minus a tail that could
    still be the start of a marker; ``finish`` releases the tail once all the text has been
    scanned. Only the unsent text and a marker's length before it are kept, so a step costs
    what it adds, not what the stream holds so far.
    """

    def __init__(self, scanner: ContentScanner, tenant_id: str) -> None:
        self._scanner = scanner
        self._tenant_id = tenant_id
        self._tail = ""  # the text from ``_tail_start`` on: a marker's length before the unsent
        self._tail_start = 0
        self._length = 0
        self._sent = 0
        self._extra_tail = ""

    @property
    def sent_chars(self) -> int:
        """How much of the text has been handed out."""
        return self._sent

    @property
    def length(self) -> int:
        """How much text has been fed."""
        return self._length

    def scan_extra(self, new_text: str) -> None:
        """Scan other text that grows with the stream (the log probabilities' tokens), what it
        adds with a marker's length of what came before."""
        text = self._extra_tail + new_text
        if self._scanner.foreign_marker(text, self._tenant_id) is not None:
            raise IsolationFailure(FOREIGN_MARKER_REASON)
        keep = self._scanner.holdback_chars
        self._extra_tail = text[len(text) - keep :] if keep else ""

    def feed(self, new_text: str) -> str:
        self._tail += new_text
        self._length += len(new_text)
        self._scan()
        safe_until = self._length
        if self._scanner.holdback_chars:
            # Only a marker still incomplete at the end can hide in the text: it begins within the
            # last holdback_chars, with the marker's first character. Hold back from there only,
            # so ordinary text streams without delay.
            window = max(self._sent, self._length - self._scanner.holdback_chars)
            start = self._tail.find(self._scanner.marker_start, window - self._tail_start)
            if start != -1:
                safe_until = self._tail_start + start
        return self._release(max(self._sent, safe_until))

    def finish(self) -> str:
        self._scan()
        return self._release(self._length)

    def _release(self, until: int) -> str:
        delta = self._tail[self._sent - self._tail_start : until - self._tail_start]
        self._sent = until
        keep_from = max(0, until - self._scanner.holdback_chars)
        if keep_from > self._tail_start:
            self._tail = self._tail[keep_from - self._tail_start :]
            self._tail_start = keep_from
        return delta

    def _scan(self) -> None:
        # Only the unsent region plus a marker-length overlap can hold a new marker.
        start = max(0, self._sent - self._scanner.holdback_chars)
        marker = self._scanner.foreign_marker(
            self._tail[start - self._tail_start :], self._tenant_id
        )
        if marker is not None:
            raise IsolationFailure(FOREIGN_MARKER_REASON)


# The ``meta_info`` lists that SGLang without ``--incremental-streaming-output`` repeats whole.
_REPEATED_META_LISTS = ("output_token_logprobs", "output_top_logprobs")


class IncrementalChunks:
    """Decode's stream chunks as what each adds, whichever way the engine sends them.

    SGLang started with ``--incremental-streaming-output`` sends each chunk's new text, token
    ids and log probabilities only. Without it, every chunk repeats the whole output so far:
    a stream of n tokens carries n²/2 tokens' worth of text and log probabilities, and checking
    each chunk whole cost the gateway's loop tens of milliseconds per token late in a long
    stream with ``top_logprobs``. The checks downstream read only what a chunk adds; for an
    engine that repeats, ``new_part`` cuts the repetition off, first checking that it is one
    (the engine never rewrites text it already sent).
    """

    def __init__(self, repeats_output: bool) -> None:
        self._repeats_output = repeats_output
        self._tokens = 0  # completion tokens before the next chunk
        self._text = ""

    def checked(self, chunk: dict[str, Any], expected: Expectation) -> dict[str, Any]:
        """``chunk`` as what it adds, once it passed ``check_meta``."""
        part = self.new_part(chunk)
        meta = part.get("meta_info")
        output = not refused_before_output(part, self._tokens)
        check_meta(meta, expected, self._tokens, output=output)
        assert isinstance(meta, dict)  # check_meta refuses anything else
        self._tokens = meta.get("completion_tokens", 0)
        return part

    def new_part(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """``chunk`` as what it adds to the ones before it (its own tokens' log probabilities:
        those after the tokens of the chunks before it)."""
        if not self._repeats_output:
            return chunk
        text = chunk.get("text") or ""
        if not text.startswith(self._text):
            raise IsolationFailure("stream text was rewritten by the engine")
        part = dict(chunk, text=text[len(self._text) :])
        self._text = text
        meta = chunk.get("meta_info")
        if isinstance(meta, dict):
            meta = part["meta_info"] = dict(meta)
            for key in _REPEATED_META_LISTS:
                if isinstance(values := meta.get(key), list):
                    meta[key] = values[self._tokens :]
        return part


def refused_before_output(part: dict[str, Any], tokens_before: int) -> bool:
    """Whether a stream chunk (as what it adds) ends its generation with an abort and adds
    nothing: no text, no token. Decode then never read the KV pages its coverage check guards,
    and says so (not verified), as when it could not compile the request's grammar (its count
    of the prompt then depends on where the request was refused: the whole prompt, or 1); the
    abort is the engine's refusal (``finish_reason_of``), not an isolation failure."""
    meta = part.get("meta_info")
    if not isinstance(meta, dict) or part.get("text"):
        return False
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind == "abort" and meta.get("completion_tokens", 0) == tokens_before


def check_text(scanner: ContentScanner, text: str, tenant_id: str) -> None:
    if scanner.foreign_marker(text, tenant_id) is not None:
        raise IsolationFailure(FOREIGN_MARKER_REASON)
