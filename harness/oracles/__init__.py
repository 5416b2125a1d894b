"""The harness's own oracles: independent views of what the engine must hold after every sync. They
read the checkpoint on disk and the trainer step's definition, never the export or the transport."""
