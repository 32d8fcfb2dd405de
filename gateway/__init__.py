"""isogate: a multi-tenant OpenAI-compatible gateway for SGLang PD clusters.

One package per concern; imports between them run one way, top to bottom:

    cli -> api -> service -> core, server
    core -> verification, openai, tenancy, observability
    verification, tenancy -> observability -> workers -> config -> tool_parsers, common

A package may import any package below it, never one above or beside it that is not listed.
``dev`` (the local CPU cluster and test harness) stands apart: no package of the product imports
it.
"""
