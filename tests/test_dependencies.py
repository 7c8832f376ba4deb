"""The installed dependencies are the ones `pyproject.toml` asks for where it matters
beyond the version range JAX accepts."""

import sys
from importlib.metadata import version

import pytest
from packaging.version import Version


@pytest.mark.skipif(
    sys.version_info >= (3, 12), reason="pyproject constrains ml_dtypes on Python 3.11 only"
)
def test_ml_dtypes_is_not_the_one_that_slows_every_jax_import():
    """ml_dtypes >= 0.7 with NumPy < 2.5 makes `import jax` about a second slower in
    every process (docs/install.md): on Python 3.11, where NumPy 2.5 cannot be had,
    pyproject keeps ml_dtypes < 0.7. Dropping that constraint fails here."""
    numpy, ml_dtypes = Version(version("numpy")), Version(version("ml_dtypes"))
    assert not (numpy < Version("2.5") and ml_dtypes >= Version("0.7")), (numpy, ml_dtypes)
