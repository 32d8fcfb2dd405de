"""The checks on every response: tags, token counts and other tenants' canary markers.

Owns: ``check_meta`` and the stream guard (fail closed: a failure is ``IsolationFailure``), and
the canary scanner. May import ``common`` and ``observability``; nothing above.
"""
