"""The ``isogate`` command: serve, migrate, check pools, and the admin and audit commands.

The top floor: it may import every package and nothing imports it.
"""
