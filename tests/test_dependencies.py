"""The installed dependencies are the ones `pyproject.toml` asks for where it matters
beyond the version range JAX accepts."""

from importlib.metadata import version

from packaging.version import Version


def test_ml_dtypes_is_not_the_one_that_slows_every_jax_import():
    """ml_dtypes >= 0.7 with NumPy < 2.5 makes `import jax` about a second slower in
    every process (docs/install.md): pyproject keeps ml_dtypes < 0.7 where NumPy 2.5 is
    not available (Python 3.11). Dropping that constraint fails here, not in CI's time."""
    numpy, ml_dtypes = Version(version("numpy")), Version(version("ml_dtypes"))
    assert not (numpy < Version("2.5") and ml_dtypes >= Version("0.7")), (numpy, ml_dtypes)
