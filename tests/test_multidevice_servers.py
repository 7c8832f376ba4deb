"""Runs the multi-device serving tests (replicas, one replica across processes, a
served mesh) in a child pytest process (`multidevice_env.run_multidevice`)."""

from multidevice_env import run_multidevice
from test_multidevice import SERVERS


def test_multidevice_serving_suite():
    run_multidevice([f"tests/multidevice/{name}" for name in SERVERS])
