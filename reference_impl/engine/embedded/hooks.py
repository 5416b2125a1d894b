"""Fault hooks of the embedded engine: `MODULE:FUNCTION` functions that replace engine seams
(`reference_impl.seams`) in the server's process, for the harness's mutation tests only. One is loaded at
start (`--fault`) or at an in-place restart (`/wsh/restart` with `fault`), and stays until the next
restart undoes it (`embedded.restart`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def load_hook(spec: str) -> Callable[[], None]:
    """The function named by `MODULE:FUNCTION` (imported, not called).

    Raises:
        ValueError: `spec` is not MODULE:FUNCTION, the module does not import (any error while importing
            it), or it has no such function.
    """
    module_name, sep, func = spec.partition(":")
    if not sep or not module_name or not func:
        raise ValueError(f"{spec!r} is not MODULE:FUNCTION (e.g. harness.faults.engine:ok_without_transfer)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or a SyntaxError or any error its import raises
        raise ValueError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    hook = getattr(module, func, None)
    if not callable(hook):
        raise ValueError(f"{module_name} has no function {func!r}")
    return hook


def apply_hook(spec: str, hook: Callable[[], None]) -> None:
    """Call `hook` (loaded from `spec`) before the engine app is built, and say so on standard error
    (`wsh engine: FAULT ACTIVE: <spec>: <first line of its docstring>`), which goes to the engine's log."""
    hook()
    doc = (hook.__doc__ or "").strip().splitlines()
    print(f"wsh engine: FAULT ACTIVE: {spec}: {doc[0] if doc else ''}", file=sys.stderr, flush=True)
