"""The model's own tokenizer and chat template, so the gateway counts exactly what the engine runs.

The gateway renders the chat template (HF-compatible Jinja) and encodes with the model's
``tokenizer.json``; the engine receives ``input_ids``, never text, so the count used for
admission is the count the engine sees. Large prompts are encoded off the event loop.

Message content is text, never structure: the texts of the tokenizer's special and added tokens
(``<|eos|>``, ``<think>``, ...) inside a message are encoded as the plain characters they are, so
only the chat template's own text yields control tokens and a message cannot forge a turn. A
model's policy may refuse such content instead (``ControlText``); completion prompts, which the
tenant writes whole, keep the tokens recognised unless the policy says otherwise.

``min_tokens_for_bytes`` gives a lower bound on the token count from the UTF-8 byte length
alone (no token is longer than the longest entry in the vocabulary), which lets admission
refuse a 50 MB prompt without tokenizing it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import anyio.to_thread
from jinja2 import Template, meta
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.common.errors import bad_request

# Token texts decoded once each, up to this many (a vocabulary's worth for most models).
_TOKEN_TEXTS_KEPT = 262_144

# What a tenant's text does with the texts of special and added tokens: "recognise" them as the
# tokens (the library's default), encode them as "plain" text, or "refuse" the request (400).
ControlText = Literal["recognise", "plain", "refuse"]
# Stands for message ``i`` in a rendering of the template's own text (private-use characters).
_SLOT = "\ue000{}\ue001"
_SLOT_PATTERN = re.compile("\ue000([0-9]+)\ue001")


class TokenizerLoadError(Exception):
    pass


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    # The message's other fields as the template sees them (tool_calls, tool_call_id, name).
    fields: dict[str, Any] | None = None


class ModelTokenizer:
    def __init__(self, directory: Path, *, thread_min_chars: int = 16_384) -> None:
        tokenizer_file = directory / "tokenizer.json"
        config_file = directory / "tokenizer_config.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(
                f"{tokenizer_file}: missing (the model's own tokenizer is required)"
            )
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config: dict[str, Any] = (
            json.loads(config_file.read_text()) if config_file.is_file() else {}
        )
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = _compile_template(template) if template else None
        # The variables the template reads that a request may set (chat_template_kwargs).
        self._template_variables = _settable_variables(template) if template else frozenset()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_token_bytes = _longest_token_bytes(self._tokenizer)
        self._thread_min_chars = thread_min_chars
        self._turn_batch = _TurnBatch(self._tokenizer)
        self._token_texts: dict[int, str] = {}
        self._controls = _ControlTokens(self._tokenizer)
        self._plain_batch = _TurnBatch(self._controls.plain)

    # -- counting without tokenizing ------------------------------------------------------

    def min_tokens_for_bytes(self, byte_length: int) -> int:
        return -(-byte_length // self.max_token_bytes)

    # -- encoding --------------------------------------------------------------------------

    def render_chat(
        self,
        turns: Sequence[ChatTurn],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        generation_prompt: bool = True,
    ) -> str:
        """The conversation as the template renders it, with ``tools`` (the request's tool
        definitions), each message's own fields and ``template_kwargs`` (a request's
        ``chat_template_kwargs``: only the variables the template reads, ``template_variables``),
        as Hugging Face's ``apply_chat_template`` passes them."""
        if self._template is None:
            raise bad_request(
                "This model has no chat template; use /v1/completions.", code="no_chat_template"
            )
        variables = self.template_variables(template_kwargs) if template_kwargs else {}
        try:
            return self._template.render(
                variables,
                messages=[
                    {"role": t.role, "content": t.content, **(t.fields or {})} for t in turns
                ],
                tools=tools or None,
                add_generation_prompt=generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise bad_request(
                f"The chat template rejected the messages: {exc}", code="invalid_messages"
            ) from exc

    def template_variables(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A request's ``chat_template_kwargs`` as the template may be given them: the
        variables it reads, and nothing else (a name it does not read has no effect, as in
        SGLang, so it is not passed). A 400 for a variable the gateway sets itself (messages,
        tools, bos_token...) and for text holding a control token's text, which the template
        would place as its own and so as the control token itself."""
        reserved = sorted(_GATEWAY_VARIABLES.intersection(kwargs))
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set '{reserved[0]}': the gateway sets it.",
                code="invalid_value",
                param="chat_template_kwargs",
            )
        variables = {k: v for k, v in kwargs.items() if k in self._template_variables}
        if variables and self._controls.found_in(list(_texts_in(variables))):
            raise _control_text_refused("chat_template_kwargs")
        return variables

    async def encode_chat(
        self,
        turns: Sequence[ChatTurn],
        *,
        control_text: ControlText = "plain",
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        generation_prompt: bool = True,
        continuation: str | None = None,
    ) -> list[int]:
        """The rendered conversation's ids. Control-token texts inside messages are plain text
        (``control_text="plain"``) or refused (``"refuse"``); ``"recognise"`` is the library's
        default, which lets a message forge turns. In tool definitions and a message's other
        fields (tool calls), whose text the template may rewrite, such text is refused.

        ``continuation`` (``continue_final_message``): the final assistant message's text, left
        out of the rendering and its tokens appended after it, as SGLang's server does."""
        ids = await self._encode_conversation(
            turns, control_text, tools, template_kwargs, generation_prompt
        )
        if continuation is None:
            return ids
        return ids + await self._continuation_ids(continuation, control_text)

    async def _continuation_ids(self, text: str, control_text: ControlText) -> list[int]:
        """The text's ids as SGLang appends them: encoded with special tokens, less a leading
        BOS; control-token texts in it as in any message."""
        tokenizer = None
        if control_text != "recognise" and await self._holds_control_text([text]):
            if control_text == "refuse":
                raise _control_text_refused("messages")
            tokenizer = self._controls.plain
        ids = await self._encode(text, add_special_tokens=True, tokenizer=tokenizer)
        bos = self._tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        return ids[1:] if ids and bos is not None and ids[0] == bos else ids

    async def _encode_conversation(
        self,
        turns: Sequence[ChatTurn],
        control_text: ControlText,
        tools: Sequence[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        generation_prompt: bool,
    ) -> list[int]:
        # The template places BOS/EOS itself; adding special tokens again would double them.
        rendered = self.render_chat(
            turns, tools, template_kwargs=template_kwargs, generation_prompt=generation_prompt
        )
        if control_text != "recognise":
            structured = [json.dumps(t.fields, ensure_ascii=False) for t in turns if t.fields]
            if tools:
                structured.append(json.dumps(list(tools), ensure_ascii=False))
            if structured and await self._holds_control_text(structured):
                raise _control_text_refused("tools")
        if control_text == "recognise" or not await self._holds_control_text(
            [turn.content for turn in turns]
        ):
            return await self._encode(rendered, add_special_tokens=False)
        if control_text == "refuse":
            raise _control_text_refused("messages")
        pieces = self._structure(turns, rendered, tools, template_kwargs, generation_prompt)
        if pieces is None:
            # The template rewrites content (trims it, splits it...), so where a message's text
            # lies in the rendering is unknown: refuse rather than guess.
            raise _control_text_refused("messages")
        return await self._encode_pieces(pieces)

    async def encode_text(
        self, text: str, *, add_special_tokens: bool = True, control_text: ControlText = "recognise"
    ) -> list[int]:
        # A generation always adds them (as SGLang does); ``/v1/tokenize`` may be told not to.
        if control_text != "recognise" and await self._holds_control_text([text]):
            if control_text == "refuse":
                raise _control_text_refused("prompt")
            return await self._encode(
                text, add_special_tokens=add_special_tokens, tokenizer=self._controls.plain
            )
        return await self._encode(text, add_special_tokens=add_special_tokens)

    async def encode_texts(
        self,
        texts: Sequence[str],
        *,
        add_special_tokens: bool = True,
        control_text: ControlText = "recognise",
    ) -> list[list[int]]:
        """Each text's ids, as ``encode_text`` gives them (``/v1/tokenize``'s list of prompts).
        Texts long enough together are encoded in one call off the event loop, checked for
        control text there too: never one encoding per turn of the loop, as short texts are
        one by one."""
        if sum(map(len, texts)) < self._thread_min_chars:
            return [
                await self.encode_text(
                    text, add_special_tokens=add_special_tokens, control_text=control_text
                )
                for text in texts
            ]
        return await anyio.to_thread.run_sync(
            self._encode_texts_now, list(texts), add_special_tokens, control_text
        )

    def _encode_texts_now(
        self, texts: list[str], add_special_tokens: bool, control_text: ControlText
    ) -> list[list[int]]:
        plain = (
            [self._controls.found_in([text]) for text in texts]
            if control_text != "recognise"
            else [False] * len(texts)
        )
        if control_text == "refuse" and any(plain):
            raise _control_text_refused("prompt")
        encoded = self._tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        ids = [e.ids for e in encoded]
        if any(plain):  # the texts holding control text again, with it read as plain text
            indices = [index for index, is_plain in enumerate(plain) if is_plain]
            again = self._controls.plain.encode_batch_fast(
                [texts[index] for index in indices], add_special_tokens=add_special_tokens
            )
            for index, e in zip(indices, again, strict=True):
                ids[index] = e.ids
        return ids

    async def _holds_control_text(self, texts: Sequence[str]) -> bool:
        if sum(len(text) for text in texts) < self._thread_min_chars:
            return self._controls.found_in(texts)
        return await anyio.to_thread.run_sync(self._controls.found_in, texts)

    def _structure(
        self,
        turns: Sequence[ChatTurn],
        rendered: str,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        generation_prompt: bool = True,
    ) -> list[str | int] | None:
        """``rendered`` as text pieces and the ids of the template's own control tokens, or None
        where the template's text cannot be told from the messages'.

        The template is rendered again with a slot in place of each message; the control tokens
        found between slots are the template's. The pieces between those tokens are what the
        library would encode between them, messages included, so content without control text
        gets the same ids either way."""
        skeleton = self.render_chat(
            [
                ChatTurn(turn.role, _SLOT.format(index), turn.fields)
                for index, turn in enumerate(turns)
            ],
            tools,
            template_kwargs=template_kwargs,
            generation_prompt=generation_prompt,
        )
        pieces: list[str | int] = []
        text: list[str] = []  # the piece being gathered
        at = 0
        for slot in [*_SLOT_PATTERN.finditer(skeleton), None]:
            between = skeleton[at : slot.start() if slot else len(skeleton)]
            start = 0
            for match in self._controls.pattern.finditer(between):
                text.append(between[start : match.start()])
                pieces.extend(("".join(text), self._controls.ids[match.group()]))
                text = []
                start = match.end()
            text.append(between[start:])
            if slot is None:
                break
            index = int(slot.group(1))
            if index >= len(turns):
                return None
            text.append(turns[index].content)
            at = slot.end()
        pieces.append("".join(text))
        # The slots stood where the messages stand only if the template used them verbatim.
        if "".join(p if isinstance(p, str) else self._controls.texts[p] for p in pieces) != (
            rendered
        ):
            return None
        return [piece for piece in pieces if piece != ""]

    async def _encode_pieces(self, pieces: list[str | int]) -> list[int]:
        texts = [piece for piece in pieces if isinstance(piece, str)]

        def encode() -> list[int]:
            encoded = iter(self._controls.plain.encode_batch_fast(texts, add_special_tokens=False))
            ids: list[int] = []
            for piece in pieces:
                if isinstance(piece, int):
                    ids.append(piece)
                else:
                    ids.extend(next(encoded).ids)
            return ids

        if sum(len(text) for text in texts) < self._thread_min_chars:
            return encode()
        return await anyio.to_thread.run_sync(encode)

    def token_text(self, token_id: int) -> str:
        """One token's text as this tokenizer decodes it alone (for log probabilities)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < _TOKEN_TEXTS_KEPT:
                self._token_texts[token_id] = text
        return text

    def check_token_ids(self, ids: Sequence[int], *, param: str = "prompt") -> list[int]:
        for index, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise bad_request(
                    f"Token id {token} at position {index} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1}).",
                    code="invalid_value",
                    param=param,
                )
        return list(ids)

    # -- decoding --------------------------------------------------------------------------

    async def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (``/v1/detokenize``); 400 for an id outside the vocabulary.
        Long lists are decoded off the event loop, as long texts are encoded."""
        checked = self.check_token_ids(ids, param="tokens")
        if len(checked) < self._thread_min_chars:
            return self._tokenizer.decode(checked, skip_special_tokens=skip_special_tokens)
        return await anyio.to_thread.run_sync(
            lambda: self._tokenizer.decode_batch(
                [checked], skip_special_tokens=skip_special_tokens
            )[0]
        )

    async def decode_lists(
        self, lists: Sequence[Sequence[int]], *, skip_special_tokens: bool = True
    ) -> list[str]:
        """Each list's text, as ``decode`` gives it; 400 for an id outside the vocabulary. Lists
        long enough together are checked and decoded in one call off the event loop."""

        def decode_all() -> list[str]:
            checked = [self.check_token_ids(ids, param="tokens") for ids in lists]
            return self._tokenizer.decode_batch(checked, skip_special_tokens=skip_special_tokens)

        if sum(map(len, lists)) < self._thread_min_chars:
            return decode_all()
        return await anyio.to_thread.run_sync(decode_all)

    def _encode(
        self, text: str, *, add_special_tokens: bool, tokenizer: Tokenizer | None = None
    ) -> Awaitable[list[int]]:
        """The ids of ``text``, to await. Not a coroutine itself: the caller awaits the batch's
        future (or the thread's result) in its own frame, one frame less to resume."""
        plain = tokenizer is not None
        tokenizer = tokenizer or self._tokenizer
        if len(text) < self._thread_min_chars:
            batch = self._plain_batch if plain else self._turn_batch
            return batch.submit(text, add_special_tokens)
        # Long prompts would stall every other request for as long as they take. ``encode``
        # holds the GIL; ``encode_batch`` releases it, so the loop keeps serving meanwhile.
        # Reading .ids builds a Python list (about 25 ms at 1M tokens): also off the loop.
        return anyio.to_thread.run_sync(
            lambda: tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        )


class _TurnBatch:
    """Short prompts submitted during one turn of the event loop, encoded together at the next.

    Why: the first encode after other work runs on cold caches (the tokenizer's tables were
    evicted by everything a request does); encoding the prompts of requests that arrived
    together back to back pays that once per turn instead of once per request. Measured in
    process with 16 requests in flight (~4 prompts per turn): 43 µs less CPU per request. The
    only wait it adds is one turn of the loop. A turn encodes at most ``_TURN_CHARS`` characters
    before it lets the loop run again, so a burst of prompts cannot hold the loop much longer
    than tokenizing them one by one would.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._pending: deque[tuple[str, bool, asyncio.Future[list[int]]]] = deque()
        self._scheduled_on: asyncio.AbstractEventLoop | None = None

    def submit(self, text: str, add_special_tokens: bool) -> asyncio.Future[list[int]]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int]] = loop.create_future()
        self._pending.append((text, add_special_tokens, future))
        if self._scheduled_on is not loop:
            self._scheduled_on = loop
            loop.call_soon(self._encode_pending, loop)
        return future

    def _encode_pending(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled_on = None
        chars = 0
        while self._pending and chars < _TURN_CHARS:
            text, add_special_tokens, future = self._pending.popleft()
            if future.cancelled() or future.get_loop() is not loop:
                continue  # the request went away (or its loop did, in tests)
            chars += len(text)
            # ``encode_batch_fast`` skips the character offsets nobody here reads (18 instead
            # of 28 µs for a short prompt); one item at a time, so no thread pool is involved.
            try:
                future.set_result(
                    self._tokenizer.encode_batch_fast(
                        [text], add_special_tokens=add_special_tokens
                    )[0].ids
                )
            except Exception as exc:
                future.set_exception(exc)
        if self._pending:
            self._scheduled_on = loop
            loop.call_soon(self._encode_pending, loop)


_TURN_CHARS = 65_536


class _ControlTokens:
    """The texts of a tokenizer's special and added tokens, where they occur, and a copy of the
    tokenizer that reads them as plain text.

    Why a copy without its added vocabulary rather than ``encode_special_tokens``: that flag
    leaves added tokens that are not marked special (``<think>`` in several models) recognised.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        added = tokenizer.get_added_tokens_decoder()
        self.texts: dict[int, str] = {token_id: token.content for token_id, token in added.items()}
        self.ids: dict[str, int] = {text: token_id for token_id, text in self.texts.items()}
        # Longest first: the alternation takes the first that matches, the library the longest.
        alternatives = sorted(self.ids, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, alternatives)) or "(?!)")
        # Texts the library normalizes before matching are looked for in normalized form too.
        self._normalizer = (
            tokenizer.normalizer
            if tokenizer.normalizer is not None and any(t.normalized for t in added.values())
            else None
        )
        spec = json.loads(tokenizer.to_str())
        spec["added_tokens"] = []
        self.plain = Tokenizer.from_str(json.dumps(spec))

    def found_in(self, texts: Sequence[str]) -> bool:
        for text in texts:
            if self.pattern.search(text):
                return True
            if self._normalizer is not None and self.pattern.search(
                self._normalizer.normalize_str(text)
            ):
                return True
        return False


def _control_text_refused(param: str) -> Exception:
    return bad_request(
        "The text holds a special token of this model's tokenizer, which this model's policy "
        "does not accept in text.",
        code="control_token_in_text",
        param=param,
    )


# The variables the gateway gives every rendering (beside the environment's globals): a
# request's chat_template_kwargs may not set them.
_RENDER_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


def _settable_variables(source: str) -> frozenset[str]:
    """The variables ``source`` reads from its context, less those the gateway sets."""
    env = _environment()
    return frozenset(meta.find_undeclared_variables(env.parse(source))) - _GATEWAY_VARIABLES


def _texts_in(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _texts_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from _texts_in(item)


def _environment() -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now(UTC).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


_GATEWAY_VARIABLES = _RENDER_VARIABLES | frozenset(_environment().globals)


def _compile_template(source: str) -> Template:
    env = _environment()
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise TokenizerLoadError(f"chat template does not compile: {exc}") from exc


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # AddedToken serialised form
        return str(value.get("content", ""))
    return value or ""


def _longest_token_bytes(tokenizer: Tokenizer) -> int:
    """Bytes of the longest vocabulary entry once decoded (at least 1).

    Decoding a partial UTF-8 byte yields U+FFFD (3 bytes), which only overestimates: the bound
    derived from it stays a valid lower bound on the token count.
    """
    longest = 1
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        longest = max(longest, len(text.encode("utf-8")))
    for added in tokenizer.get_added_tokens_decoder().values():
        longest = max(longest, len(added.content.encode("utf-8")))
    return longest
