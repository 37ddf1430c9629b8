"""How a run's Redis is given: a URL, or Sentinels and the primary they watch (kombu's form)."""

from __future__ import annotations

import pytest

from orchestrator.settings import RunSettings
from tasks.logs import mask_secrets
from transport.connection import RedisAddress, celery_redis_options


def test_a_plain_url_is_itself():
    address = RedisAddress.parse("redis://:pw@host:6380/2")
    assert not address.is_sentinel
    assert address.celery_url == "redis://:pw@host:6380/2"
    assert celery_redis_options("redis://host/0") == {
        "broker_url": "redis://host/0",
        "result_backend": "redis://host/0",
    }


def test_sentinels_their_ports_database_password_and_master_name():
    url = "sentinel://:s3cret@10.0.0.1:26380;sentinel://10.0.0.2;sentinel://10.0.0.3:26382/3?master_name=rl"
    address = RedisAddress.parse(url)
    assert address.sentinels == (("10.0.0.1", 26380), ("10.0.0.2", 26379), ("10.0.0.3", 26382))
    assert (address.master_name, address.db, address.password) == ("rl", 3, "s3cret")
    assert address.celery_url == url.split("?")[0]
    options = celery_redis_options(url)
    assert options["broker_url"] == options["result_backend"] == url.split("?")[0]
    assert options["broker_transport_options"]["master_name"] == "rl"
    assert options["result_backend_transport_options"]["master_name"] == "rl"
    assert "s3cret" not in mask_secrets(url)


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("sentinel://127.0.0.1:26379", "master_name"),
        ("sentinel://127.0.0.1:26379/x?master_name=m", "database"),
        ("sentinel://127.0.0.1:26379;redis://127.0.0.1:6379?master_name=m", "sentinel://host:port"),
    ],
)
def test_a_malformed_sentinel_address_is_refused_naming_what(url, named):
    with pytest.raises(ValueError, match=named):
        RunSettings(redis_url=url)


def test_waiting_for_a_replica_follows_the_address_unless_set():
    sentinel = "sentinel://127.0.0.1:26379/0?master_name=m"
    assert RunSettings(redis_url=sentinel).redis_wait_replicas == 1
    assert RunSettings(redis_url="redis://127.0.0.1:6379/0").redis_wait_replicas == 0
    assert RunSettings(redis_url=sentinel, redis_wait_replicas=2).redis_wait_replicas == 2
    assert "redis_wait_replicas" in RunSettings(redis_url=sentinel).derived()
