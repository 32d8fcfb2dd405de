"""What a client is told when a worker refused its request (an engine 4xx).

The problem: the engine's own text names internals (source paths, limits, other requests), so
it is logged for operators and the client gets the gateway's words. But one refusal is about
nothing but the client's own input: a grammar (``regex``, ``ebnf``, a JSON schema, a structural
tag) that SGLang's grammar compiler cannot compile. The gateway cannot compile grammars itself
(xgrammar needs torch, which the gateway does not import), so this refusal comes from a worker,
and "the worker refused the request" alone leaves the client guessing which part of its
grammar is wrong.

The rule: a refusal's text reaches the client only where SGLang says it is its grammar
compiler's verdict ("Failed to compile <kind> grammar: ..."), and then only the verdict, with
the compiler's time and source position taken out, on one line and bounded in length. The
verdict is about this request's grammar: SGLang caches compiled grammars by their text, so a
cached refusal is the verdict on the same text. Any other engine text stays in the log.
"""

from __future__ import annotations

import re

from gateway.common.errors import APIError, clipped

# SGLang's message for a grammar its compiler refused (``sglang.srt.constrained``), by kind.
_GRAMMAR_REFUSAL = re.compile(
    r"Failed to compile (json|regex|ebnf|structural_tag) grammar: (.*)", re.DOTALL
)
_GRAMMAR_KINDS = {
    "json": "JSON schema",
    "regex": "regex",
    "ebnf": "EBNF grammar",
    "structural_tag": "structural tag",
}
# What xgrammar puts before its messages: the time and the C++ source line that raised it.
_COMPILER_POSITION = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")
_WRAPPED = "Grammar compilation failed: "  # SGLang's words for a compiler that raised
_MAX_VERDICT_CHARS = 300


def engine_refusal(role: str, engine_message: str) -> APIError:
    """400 ``engine_rejected`` for a request the ``role`` worker refused, saying why only where
    the engine's text is its grammar compiler's verdict (the module doc)."""
    refused = f"The {role} worker refused the request"
    verdict = _grammar_verdict(engine_message)
    if verdict is None:
        return APIError(400, refused + ".", "invalid_request_error", "engine_rejected")
    kind, text = verdict
    return APIError(
        400,
        f"{refused}: its {kind} does not compile ({text}).",
        "invalid_request_error",
        "engine_rejected",
        # The verdict may quote the grammar: the audit event names its kind only.
        audit_detail=f"{refused}: its {kind} does not compile.",
    )


def _grammar_verdict(engine_message: str) -> tuple[str, str] | None:
    """The grammar's kind and the compiler's verdict, cleaned; None for any other message."""
    found = _GRAMMAR_REFUSAL.match(engine_message)
    if found is None:
        return None
    kind, text = found.groups()
    text = _COMPILER_POSITION.sub("", text).removeprefix(_WRAPPED)
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split()).rstrip(".")
    return _GRAMMAR_KINDS[kind], clipped(text, _MAX_VERDICT_CHARS) or "no reason given"
