"""Giving freed host memory back to the system between scenarios."""

from __future__ import annotations

import contextlib
import ctypes
import gc


def release_memory() -> None:
    """Collect cycles, then hand the allocator's free pages back to the system (glibc's `malloc_trim`;
    nothing where there is no glibc), the host-memory analogue of `torch.cuda.empty_cache`. Freed tensors
    otherwise keep the process's resident size near its peak: glibc trims only a free region at the top of
    its heap, so a scenario's last small allocations pin the pages of its big freed ones below them."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
