"""The embedded engine's real server, driven from the test process as the trainer's sender."""
