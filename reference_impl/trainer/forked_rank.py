"""Trainer ranks forked from a fork server (`reference_impl.fork_server`, role `reference_impl.trainer.forked_rank`):
what the fork server imports once (`preload`), what a forked child runs (`run`: Ray's worker script), and the
`py_executable` a rank actor's runtime environment names (`py_executable`).

A new trainer rank is a Ray worker, a new interpreter that imports torch, megatron-core and Megatron-Bridge before
its first setup (`trainer.model.import_megatron`): about 7-9 s of CPU on a 2-core host, most of a rank's start.
Ray starts a worker as `PYTHON default_worker.py ARGS` (through `bash -c "exec PYTHON ..."` when the actor has a
runtime environment, `ray/_private/runtime_env/context.py` `exec_worker`), and its runtime environment may name
that PYTHON (`py_executable`). Ours is `python reference_impl/fork_client.py SOCKET`: it asks the fork server
for a child that runs `default_worker.py ARGS` with the worker's environment, working folder, descriptors,
priority and `oom_score_adj` (`fork_client.exec_forked`), and waits for it as the process the raylet started. The
child registers with the raylet itself, by the pid it reports; Ray then kills and watches that process, as it does
a worker a container runtime starts (the raylet uses the stand-in's pid only before the registration and for its
own shutdown). A forked rank's first line (`fork_server.FORKED_LINE`) goes to the standard error Ray gave the
stand-in, the raylet's (`raylet.err` in the Ray session's logs), before the worker sends its output to its own
log files.

The fork server does not import Ray: Ray reads its configuration and authentication token once per process, from
the environment the raylet gives each worker, and a forked child must read the child's. Not on a GPU host
(`harness.runner.Runner` does not ask for one there): Ray sets each worker's visible devices, and CUDA does not
survive a fork.
"""

from __future__ import annotations

import os
import runpy
import shlex
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reference_impl.fork_client import ForkServerAddress

ROLE = __name__  # this module, as `fork_server.ForkServer.start` names a role


def preload() -> None:
    """Import what a rank imports before its first setup: `reference_impl.worker` and Megatron
    (`trainer.model.import_megatron`).

    Raises:
        RuntimeError: on a host with a CUDA device (a forked child cannot use CUDA its parent initialised), or
            when something imported Ray (it reads its configuration once per process; see the module doc). The
            fork server then ends, and ranks start as new interpreters.
    """
    import reference_impl.worker  # noqa: F401
    from reference_impl.cuda import cuda_available
    from reference_impl.trainer.model import import_megatron

    if cuda_available():
        raise RuntimeError("trainer ranks are not forked on a host with CUDA devices")
    import_megatron()
    if "ray" in sys.modules:
        raise RuntimeError("the rank fork server imported Ray: a forked worker would keep its configuration")


def run(args: list[str]) -> None:
    """Be `python SCRIPT ARGS...` (`args` = [SCRIPT, *ARGS], Ray's `default_worker.py` and its arguments): the
    script's folder first on `sys.path`, as the interpreter puts it."""
    script = args[0]
    sys.argv = list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def py_executable(address: ForkServerAddress) -> str:
    """The `py_executable` of a rank actor's runtime environment (a shell command line) that forks its worker from
    the fork server at `address` (`fork_client.exec_forked`; a worker on a host without that socket starts as a
    new interpreter)."""
    from reference_impl import fork_client

    return " ".join(shlex.quote(a) for a in (address.python, fork_client.__file__, address.socket))
