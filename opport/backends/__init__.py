"""Backends: one folder each, whose `__init__.py` defines `BACKEND = Backend(...)`.

See docs/adding-a-backend.md. Importing a backend package must stay cheap and pure: toolchains
(torch, triton, the NKI SDK) are probed only when `Backend.probe()` is called.
"""
