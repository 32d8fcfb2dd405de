"""The engine side: the SGLang workers as the gateway sees and calls them.

Owns: each worker's live capacity (polled, shared through Redis), the (prefill, decode) pair, the
PD dispatch that sends a request to both, and the HTTP/1.1 client under it. May import
``common`` and ``config``; knows nothing of tenants, the OpenAI format or the core.
"""
