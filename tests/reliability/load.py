"""Client load for fault tests: tenants sending requests in threads, every answer recorded and
judged."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from tests.security.checks import assert_clean_error

ANY_ERROR = tuple(range(400, 600))


@dataclass(frozen=True)
class Answer:
    tenant: str
    status: int
    seconds: float
    code: str | None  # the error code, None when served
    generation_id: str | None  # the response id when served
    stream_error: bool = False  # a stream that started and ended with an error event
    ended_at: float = 0.0  # time.monotonic() when the answer was complete (set by ``Load``)

    @property
    def started_at(self) -> float:
        return self.ended_at - self.seconds


@dataclass
class Load:
    """Each tenant in its own thread, sending one request after another until ``stop``."""

    send: Callable[[httpx.Client, str], Answer]
    clients: dict[str, httpx.Client]
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        for tenant, client in self.clients.items():
            thread = threading.Thread(target=self._run, args=(tenant, client), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, tenant: str, client: httpx.Client) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                answer = self.send(client, tenant)
            except (
                Exception
            ) as exc:  # a transport failure or a malformed answer: recorded, judged by the test
                answer = Answer(
                    tenant,
                    -1,
                    time.monotonic() - started,
                    f"{type(exc).__name__}: {exc}"[:300],
                    None,
                )
            answer = dataclasses.replace(answer, ended_at=time.monotonic())
            with self._lock:
                self.answers.append(answer)

    def stop(self) -> list[Answer]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self._threads), "a client hung"
        return list(self.answers)


def send_chat(body: dict[str, Any]) -> Callable[[httpx.Client, str], Answer]:
    """A sender for ``Load``: one chat completion (streamed if ``body['stream']``), judged on the
    spot."""

    def send(client: httpx.Client, tenant: str) -> Answer:
        started = time.monotonic()
        if body.get("stream"):
            return _send_stream(client, tenant, body, started)
        response = client.post("/v1/chat/completions", json=body)
        seconds = time.monotonic() - started
        if response.status_code == 200:
            return Answer(tenant, 200, seconds, None, response.json()["id"])
        error = assert_clean_error(response.status_code, response.content, statuses=ANY_ERROR)
        return Answer(tenant, response.status_code, seconds, error["code"], None)

    return send


def _send_stream(client: httpx.Client, tenant: str, body: dict[str, Any], started: float) -> Answer:
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            content = response.read()
            error = assert_clean_error(response.status_code, content, statuses=ANY_ERROR)
            return Answer(
                tenant, response.status_code, time.monotonic() - started, error["code"], None
            )
        events = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
    seconds = time.monotonic() - started
    if events and events[-1] == "[DONE]":
        return Answer(tenant, 200, seconds, None, orjson.loads(events[0])["id"])
    # A failure after the first byte: the stream must end with exactly one error event, no [DONE].
    assert events, "a stream that started ended with no event at all"
    last = orjson.loads(events[-1])
    assert set(last) == {"error"} and last["error"]["message"], last
    assert "[DONE]" not in events
    return Answer(tenant, 200, seconds, last["error"]["code"], None, stream_error=True)


def by_tenant(answers: list[Answer], tenant: str) -> list[Answer]:
    return [a for a in answers if a.tenant == tenant]
