"""The HTTP server under the routes: bounds on what a client may send and how slowly.

Owns: uvicorn's httptools protocol with header, connection and timeout bounds, and the intake
that parses large bodies off the event loop. May import ``openai`` (to parse bodies into its
models) and ``common``; knows no route and no core.
"""
