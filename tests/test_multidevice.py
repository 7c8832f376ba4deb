"""Runs the 8-device mesh tests of models, loading and weights (`tests/multidevice/`) in
a child pytest process (`multidevice_env.run_multidevice`); the serving ones run from
`test_multidevice_servers.py`, a file of their own so that another worker takes them."""

import pathlib

from multidevice_env import ROOT, run_multidevice

SERVERS = ("test_mesh_serving.py", "test_multihost_serving.py", "test_replica_server.py")


def test_multidevice_suite():
    files = sorted(pathlib.Path(ROOT, "tests/multidevice").glob("test_*.py"))
    assert {f.name for f in files} >= set(SERVERS)
    run_multidevice([str(f.relative_to(ROOT)) for f in files if f.name not in SERVERS])
