"""The OpenAI wire format and what a prompt becomes in the model's own tokens.

Owns: the request and response schemas (``protocol``), the model's tokenizer and chat template,
and a chat request's tools read against its model's policy. May import ``common``, ``config``
and ``tool_parsers``; knows nothing of tenants, workers or HTTP.
"""
