"""Development-only helpers: a tiny local model and a local SGLang PD pair on the CPU.

Used by tests and `make run`; the production gateway never imports this package.
"""
