"""One running gateway: its parts built once, the background work, the policy reload.

Owns: ``Components`` (everything a request needs, built per process and closed on shutdown), the
canary prober (a caller of the core, like the API) and the reload of ``policies/``. May import
``core``, ``server`` and everything below them; never ``api`` or ``cli``.
"""
