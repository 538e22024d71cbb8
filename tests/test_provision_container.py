"""tests/test_provision.py's broker tests again, against a nats-server container that testcontainers starts (the
`docker` tier; tests/docker_support.py) instead of the embedded one: the wire foundation (streams, buckets,
consumers, message ids, limits) on the server the compose file runs. Its pure tests are left out here
(tests/conftest.py: `BROKER_RERUN`)."""
from __future__ import annotations

import pytest

from tests.test_provision import *  # noqa: F401,F403  (the tests and the module's fixtures)

BROKER_RERUN = True
pytestmark = [pytest.mark.docker]


@pytest.fixture(scope="module")
def nats_url(container_nats_url):
    return container_nats_url


def test_this_module_runs_against_the_broker_container(nats_url):
    from tests.docker_support import assert_served_by_a_container

    assert_served_by_a_container(nats_url)
