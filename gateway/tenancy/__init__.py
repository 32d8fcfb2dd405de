"""Who is asking and what they may do: tenants, keys, limits, the audit log and its store.

Owns: the store (SQLite or PostgreSQL), authentication and the key cache, revocations across
replicas, per-tenant limits, the audit log. May import ``common`` and ``config``; knows nothing of
the engine, the OpenAI format or HTTP.
"""
