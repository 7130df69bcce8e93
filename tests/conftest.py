import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import tiny  # noqa: E402


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The tiny model and the toy task (tests/tiny.py), once per test module; a module with another task overrides it."""
    return tiny.toy_task(tmp_path_factory.mktemp("toy"))
