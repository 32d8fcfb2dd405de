"""What the gateway is told: process settings from the environment and the platform team's
policy files (models, pools, tenants).

Owns: ``Settings``, the schema of ``policies/`` and its loading. May import ``common`` and
``tool_parsers`` (for the parser names a policy may choose); nothing above.
"""
