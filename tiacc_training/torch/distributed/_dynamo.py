"""What the package's code tells ``torch.compile``: run me as I am.

torch calls into this package from places ``torch.compile`` reaches: a
compiled DDP model's forward runs its forward hooks inside the traced
frame, and DDP's reducer (C++) calls the "tiacc" backend's collectives,
written in Python, while a compiled frame is active. Dynamo would then
trace or compile our frames, add graph breaks (locks, the engine's
calls) and recompile them for every new tensor size. torch's own files
are never traced; ours are kept out the same way:

- :func:`eager` wraps a function torch calls from C++ (the backend's
  methods, its work's ``wait``) so that dynamo runs it as it is;
- :func:`compiling` is true while dynamo traces a frame, so that a hook
  traced into a compiled graph can step out of it (it then traces to
  nothing: no graph break, no guard).

Both probe what this torch has; without ``torch.compile`` they do nothing.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_compiler = getattr(torch, "compiler", None)
_disable = getattr(_compiler, "disable", None)
_is_compiling: Callable[[], bool] = (
    getattr(_compiler, "is_compiling", None)
    or getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    or (lambda: False)
)


def eager(function: F) -> F:
    """``function``, run as it is even when called while a compiled frame is active."""
    if _disable is None:
        return function
    wrapped = _disable(function)
    for name in ("__name__", "__qualname__", "__doc__"):
        if hasattr(function, name):
            try:
                setattr(wrapped, name, getattr(function, name))
            except (AttributeError, TypeError):
                pass
    return wrapped  # type: ignore[no-any-return]


def compiling() -> bool:
    """Whether dynamo is tracing the calling frame into a graph."""
    return bool(_is_compiling())
