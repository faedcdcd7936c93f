import pytest

from tests import harness


@pytest.fixture(scope="session")
def dist2():
    return harness.pool(2)


@pytest.fixture(scope="session")
def dist4():
    return harness.pool(4)


def pytest_sessionfinish(session, exitstatus):
    harness.close_all()
