"""The offline Python API over the engine: `LLM`, the calls it serves at once, and their
progress bars."""
