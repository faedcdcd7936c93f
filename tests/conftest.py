import os

import pytest
from hypothesis import settings

from tests import harness

# Property tests draw the same examples on every run unless asked otherwise (HP_PROPERTY_RANDOM=1, or
# scripts/property_long.sh), so a CI run repeats what the last run checked; random exploration is opt-in.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("random")
settings.load_profile("random" if os.environ.get("HP_PROPERTY_RANDOM") else "repeatable")


@pytest.fixture(scope="session")
def dist2():
    return harness.pool(2)


@pytest.fixture(scope="session")
def dist4():
    return harness.pool(4)


def pytest_sessionfinish(session, exitstatus):
    harness.close_all()
