"""Output decoded under the JSON schema of ``tool_choice`` required or named: the whole output
is an array of ``{"name": ..., "parameters": {...}}``. Constrained decoding promised that, so
anything else (text around it, an unclosed array, a function nobody offered) is
``InvalidToolOutput``, never an answer; except that an output cut short by a limit the client
set (``max_tokens``, one of its stop sequences) is the promised output's beginning: its
complete calls are calls, and what follows the last of them comes back as text, as a
truncated answer of any other kind does (``finish(cut=True)``)."""

from __future__ import annotations

from typing import Any

from .types import Function, Functions, InvalidToolOutput, Parsed, ToolCall, json_items, make_call


def call_schema(functions: list[Function], parallel: bool) -> dict[str, Any]:
    """The JSON schema the engine decodes under: at least one call (exactly one without
    ``parallel``), each naming one of ``functions`` with arguments under its parameters."""
    items = []
    # A parameters schema's "$defs" move to the root, where its "#/$defs/..." refs now point.
    definitions: dict[str, Any] = {}
    for function in functions:
        parameters = dict(function.parameters) or {"type": "object"}
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise ValueError(f"two functions define '$defs/{name}' differently")
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


class CallArrayStream:
    """Emits each call as its array item completes; ``finish`` checks the whole output."""

    def __init__(self, functions: Functions) -> None:
        self._functions = functions
        self._text = ""
        self._sent = 0

    def feed(self, delta: str) -> Parsed:
        self._text += delta
        start = self._text.find("[")
        if start < 0:
            return Parsed()
        items, _closed, _end = json_items(self._text, start)
        return Parsed("", self._calls(items[self._sent :]))

    def finish(self, cut: bool = False) -> Parsed:
        """The calls not yet emitted. With ``cut`` (the engine stopped at the client's limit,
        not at the output's end) the array may be unfinished: its complete calls, then the
        rest of the output as text; every complete call is still held to the constraint."""
        text = self._text
        start = text.find("[")
        if start < 0 or text[:start].strip():
            if cut and not text[: max(start, 0)].strip():
                return Parsed(text.strip())  # cut before the array began
            raise InvalidToolOutput("the output is not a JSON array of calls")
        items, closed, end = json_items(text, start)
        if closed and not items:
            raise InvalidToolOutput("the output holds no call")
        if cut and (not closed or text[end:].strip()):
            # Unfinished, or followed by the stop sequence the client asked to keep.
            rest = text[end:] if items else text
            return Parsed(rest.strip(), self._calls(items[self._sent :]))
        if not closed or text[end:].strip():
            raise InvalidToolOutput("the calls' JSON array is not complete valid JSON")
        return Parsed("", self._calls(items[self._sent :]))

    def _calls(self, items: list[Any]) -> list[ToolCall]:
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise InvalidToolOutput("a call is not an object with a name")
            call = make_call(item["name"], item.get("parameters", {}), self._functions)
            if call is None:
                raise InvalidToolOutput("a call names a function that was not offered")
            calls.append(call)
        self._sent += len(items)
        return calls
