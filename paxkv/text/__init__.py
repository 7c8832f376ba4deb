"""Text in and out of the engine, without JAX: chat templates (rendered in a sandbox) and
incremental detokenization with stop strings."""
