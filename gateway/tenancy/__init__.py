"""Who is asking and what they may do: tenants, keys, limits, the audit log and its store.

Owns: the store (SQLite or PostgreSQL), authentication and the key cache, revocations across
replicas, limits per tenant, model and (tenant, model), token budgets, stored responses, the
audit log. May import ``common``, ``config`` and ``observability`` (the budgets' metrics); knows
nothing of the engine, the OpenAI format or HTTP.
"""
