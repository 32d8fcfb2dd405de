"""One check for every test that holds an answer to its model: ``assert_conforms``.

The gateway builds its answers as plain dicts (``gateway.openai.protocol``'s builders, the admin and
audit handlers) and describes them with pydantic models, from which ``/openapi.json`` is
generated. An answer conforms when, as sent (JSON), it validates with its model strictly
(no field missing, none extra, no type coerced) and with the served document's schema of the
same name, which is what clients and the schema fuzzer read.
"""

from __future__ import annotations

import functools
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the test extras
import orjson
from pydantic import BaseModel

from gateway.api.openapi import openapi_document


def validate_with_model(model: type[BaseModel], body: object) -> None:
    """Raises ``pydantic.ValidationError`` unless ``body``, as JSON, is exactly a ``model``."""
    model.model_validate_json(orjson.dumps(body), strict=True)


@functools.cache
def _validator(component: str) -> jsonschema.Draft202012Validator:
    document: dict[str, Any] = openapi_document()
    assert component in document["components"]["schemas"], f"no component {component!r}"
    # Resolved through the document itself, so the component's own $refs resolve too.
    schema = {"$ref": f"#/components/schemas/{component}", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


def validate_with_document(component: str, body: object) -> None:
    """Raises ``jsonschema.ValidationError`` unless ``body``, as JSON, fits the component."""
    _validator(component).validate(orjson.loads(orjson.dumps(body)))


def assert_conforms(model: type[BaseModel], body: object) -> None:
    validate_with_model(model, body)
    validate_with_document(model.__name__, body)
