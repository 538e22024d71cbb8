"""tests/test_syncer_e2e.py again, against a nats-server container that testcontainers starts (the `docker`
tier; tests/docker_support.py) instead of the embedded one: the real syncer's rounds, finalization and export
on the server the compose file runs."""
from __future__ import annotations

import pytest

from tests.test_syncer_e2e import *  # noqa: F401,F403  (the tests and the module's helpers)

BROKER_RERUN = True
pytestmark = [pytest.mark.docker]


@pytest.fixture(scope="module")
def nats_url(container_nats_url):
    return container_nats_url


def test_this_module_runs_against_the_broker_container(nats_url):
    from tests.docker_support import assert_served_by_a_container

    assert_served_by_a_container(nats_url)
