"""The routes: each reads HTTP, calls the core (or a tenancy service), writes HTTP.

Owns: the Starlette app, the OpenAI routes and the generation pipeline's HTTP side, tokenize and
detokenize, the admin and audit routes, the OpenAPI document. May import ``service`` and
everything below it; only ``cli`` imports it.
"""
