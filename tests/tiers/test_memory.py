import pytest

from kvstore.errors import InvalidInput
from tests.tiers.conformance import TierContract, tier_state_machine
from tiers.memory import MemoryTier


class TestMemoryTier(TierContract):
    @pytest.fixture
    def make_tier(self):
        made = []

        def make(capacity_bytes: int) -> MemoryTier:
            tier = MemoryTier(capacity_bytes)
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()

    def test_details_name_the_backing(self, tier):
        stats = tier.stats()
        assert stats.kind == "memory" and "heap" in stats.details["backing"]

    @pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1GiB"])
    def test_capacity_must_be_positive_int(self, bad):
        with pytest.raises(InvalidInput):
            MemoryTier(bad)


TestMemoryTierStateMachine = tier_state_machine(lambda cap: MemoryTier(cap)).TestCase
