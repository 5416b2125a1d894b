"""Embedded engine servers forked from a fork server (`reference_impl.fork_server`, role
`reference_impl.engine.embedded.forked`): what the fork server imports once (`preload`) and what a forked child runs
(`run`, the server's command line, `cli.main`).

A new server spends almost all of its start importing torch, transformers (whose masking utilities import
`torch._dynamo`), the model classes, FastAPI and uvicorn: about 6 s of CPU and 8 s of wall on a 2-core host, for a
few tenths of a second of building the model and binding its port (`python -X importtime`). A forked server answers
`/health` 0.2-0.3 s after its launch on a small checkpoint.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SERVER_MODULE = "reference_impl.engine.embedded"  # what `python -m` runs for a server (`launcher.EngineProcess`)
ROLE = __name__  # this module, as `fork_server.ForkServer.start` names a role
PRELOAD = (
    "reference_impl.engine.embedded.cli",
    "reference_impl.forward.prompts",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.lifespan.on",
    "uvicorn.loops.asyncio",
    "anyio._core._sockets",
)


def preload() -> None:
    """Import what an embedded engine server imports: `PRELOAD` and the transformers model class of every
    registered model (transformers imports them lazily, by attribute)."""
    import transformers

    from reference_impl.models.registry import available_models, load_model

    for name in PRELOAD:
        importlib.import_module(name)
    for arch in sorted({load_model(m).hf_architecture for m in available_models()}):
        getattr(transformers, arch)


def run(args: list[str]) -> None:
    """Be the server of `python -m reference_impl.engine.embedded ARGS` (`cli.main(args)`): the working folder
    first on `sys.path`, as `python -m` puts it."""
    import os

    import reference_impl.engine.embedded
    from reference_impl.engine.embedded.cli import main

    sys.path.insert(0, os.getcwd())
    # as `python -m` sets it (argparse names the program after it in its messages)
    sys.argv = [str(Path(reference_impl.engine.embedded.__file__).with_name("__main__.py")), *args]
    main(list(args))
