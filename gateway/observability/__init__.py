"""What operators read: Prometheus metrics and the structured request log.

Owns: ``Metrics`` (every series the gateway exports) and the log configuration with the
generation ID of the request being served. May import ``config`` and ``workers`` (the capacity
series) and ``common``.
"""
