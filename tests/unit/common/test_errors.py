"""An error quotes at most a short prefix of what the client sent: a 5 MB model name or field
name is not answered with a 5 MB error (nor logged whole)."""

from __future__ import annotations

import orjson
import pytest

from gateway.common.errors import (
    MESSAGE_CHARS,
    PARAM_CHARS,
    QUOTE_CHARS,
    APIError,
    model_not_found,
    quoted,
)
from gateway.openai import protocol

HUGE = "m" * 5_000_000


def test_a_short_input_is_quoted_whole() -> None:
    assert quoted("tiny-llama") == "'tiny-llama'"


def test_a_long_input_is_quoted_to_a_prefix_with_an_ellipsis() -> None:
    assert quoted(HUGE) == repr("m" * QUOTE_CHARS) + "…"


def test_control_characters_in_a_quote_cannot_break_a_log_line() -> None:
    assert "\n" not in quoted("a\nb") and "\x1b" not in quoted("\x1b[2J")


def test_the_404_for_an_unknown_model_quotes_a_prefix_of_its_name() -> None:
    error = model_not_found(HUGE)
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert len(error.message) < 2 * QUOTE_CHARS
    assert "m" * QUOTE_CHARS in error.message


def test_every_error_is_capped_even_one_built_from_client_input_unquoted() -> None:
    error = APIError(404, f"The model '{HUGE}' does not exist.", param=HUGE)
    assert len(error.message) <= MESSAGE_CHARS + 1
    assert error.param is not None and len(error.param) <= PARAM_CHARS + 1
    assert len(orjson.dumps(error.body())) < 2 * MESSAGE_CHARS


@pytest.mark.parametrize(
    ("schema", "fields"),
    [
        (protocol.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
        (protocol.CompletionRequest, {"prompt": "x"}),
    ],
    ids=["chat", "text"],
)
def test_an_unknown_field_with_a_huge_name_is_named_by_a_prefix(
    schema: type[protocol._Request], fields: dict[str, object]
) -> None:
    with pytest.raises(APIError) as caught:
        protocol.parse_request(orjson.dumps({"model": "m", **fields, HUGE: 1}), schema)
    error = caught.value
    assert (error.status, error.code) == (400, "unknown_parameter")
    assert len(error.message) < 4 * QUOTE_CHARS
    assert error.param is not None and len(error.param) <= QUOTE_CHARS + 1
