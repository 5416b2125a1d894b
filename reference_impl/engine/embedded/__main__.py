"""`python -m reference_impl.engine.embedded --checkpoint DIR ...`: start the embedded engine (flags and
routes: `reference_impl.engine.embedded.server`).

The server module is imported under its own name here, never run as `__main__`: a fault hook that
replaces one of its seams (`reference_impl.seams`, e.g. `EngineState.commit_version`) then replaces what
the running app calls, not a second copy of the module."""

from reference_impl.engine.embedded.cli import main

main()
