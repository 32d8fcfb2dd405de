"""The generation core, free of HTTP: admit, claim, queue, dispatch, verify, audit.

Every caller (the HTTP routes, the canary prober, every prompt of a batch and every choice of
``n``) goes through ``GenerationCore``; nothing reaches a worker around it. Owns gate 1 (admission
and the claim ledger, shared between processes through Redis when configured), routing to a
pair, the fair queue per pair, and ``Held``, what one request holds. May import every package
below it (``verification``, ``openai``, ``tenancy``, ``observability``, ``workers``, ``config``,
``tool_parsers``, ``common``); never ``server``, ``service``, ``api`` or ``cli``.
"""
