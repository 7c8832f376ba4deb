"""The environment variable that lets pytest collect `tests/multidevice/` (in a child process)."""

MULTIDEVICE_ENV = "PAXKV_MULTIDEVICE_TESTS"
