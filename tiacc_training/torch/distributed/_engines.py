"""Transitional: ``advertised_host`` for ``_collectives`` until it imports ``_runtime``.

The process's engines and default group live in ``_runtime``; this module
goes once nothing imports it.
"""

from ._runtime import advertised_host

__all__ = ["advertised_host"]
