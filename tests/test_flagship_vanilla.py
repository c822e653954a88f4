"""The flagship for the vanilla loop: the conformance suite (tests/conformance.py) on its adapter.

    pytest tests/test_flagship_vanilla.py -q
"""

import pytest

from .conformance import *  # noqa: F401,F403  (the suite's tests and fixtures run here)
from .conformance import VANILLA, Adapter


@pytest.fixture
def adapter() -> Adapter:
    return VANILLA
