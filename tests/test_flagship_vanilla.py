"""The flagship for the vanilla loop: the conformance suite (tests/conformance.py) on its adapter.

pytest tests/test_flagship_vanilla.py -q
"""

from .conformance import VANILLA, ConformanceSuite


class TestVanillaConformance(ConformanceSuite):
    ADAPTER = VANILLA
