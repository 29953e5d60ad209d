"""Fixtures of the Python interop suite.

torch is imported at module level on purpose: without torch the suite must fail, never skip.
"""

import os
import sys
from pathlib import Path

# The workers the suite starts keep nothing of the disk free: the tests need little scratch, and a
# nearly full machine must not stall their rank tasks (the default reserve is 1 GiB).
os.environ.setdefault("SHARDLINE_SCRATCH_RESERVE", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402,F401  (first: a missing torch must be the error reported)
import pytest  # noqa: E402
import safetensors  # noqa: E402,F401

from harness import FIXTURE_NAMES, FIXTURES, Conversions, shardline_bin  # noqa: E402,F401

# Tests import these names from conftest (re-exported from harness).
__all__ = ["FIXTURES", "FIXTURE_NAMES"]


@pytest.fixture(scope="session")
def shardline():
    try:
        return shardline_bin()
    except FileNotFoundError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def conversions(shardline, tmp_path_factory):
    return Conversions(tmp_path_factory.mktemp("converted"))


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory):
    """The built wheel (`SHARDLINE_WHEEL`, from scripts/build-wheel) installed into a fresh venv
    by pip, with no Rust toolchain on PATH: what a user without cargo gets."""
    import wheel_env

    try:
        return wheel_env.install(tmp_path_factory.mktemp("wheel-venv"))
    except wheel_env.NoWheel as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def sl(installed_wheel):
    """The `shardline` Python module, imported from the fresh venv (never from the source tree);
    torch and numpy come from the suite's venv."""
    return installed_wheel.import_module()
