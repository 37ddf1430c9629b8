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


def test_tls_options_reach_every_client_and_a_wrong_one_is_named(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    sentinels = f"sentinel://s1:26379;sentinel://s2:26379/0?master_name=m&ssl_ca_certs={ca}"
    address = RedisAddress.parse(sentinels)
    assert address.uses_tls and address.master_options()["ssl_ca_certs"] == str(ca)
    assert address.sentinel_options()["ssl"] is True  # the Sentinels too
    assert celery_redis_options(sentinels)["broker_use_ssl"] == {
        "ssl_cert_reqs": "required",
        "ssl_ca_certs": str(ca),
    }
    assert celery_redis_options(f"rediss://h:1/0?ssl_ca_certs={ca}")["broker_url"] == "rediss://h:1/0"
    for url, named in (
        (f"redis://h:1/0?ssl_ca_certs={ca}", "need a rediss:// URL"),
        ("rediss://h:1/0?ssl_ca_certs=/nowhere.pem", "ssl_ca_certs: there is no file"),
        ("rediss://h:1/0?ssl_check_hostname=false", "ssl_check_hostname: the TLS options"),
        ("rediss://h:1/0?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of"),
    ):
        with pytest.raises(ValueError, match=named):
            RunSettings(redis_url=url)


def test_a_roles_user_replaces_the_urls():
    settings = RunSettings(redis_url="redis://:admin@h:1/0", redis_producer_auth="p:s@cret")
    assert settings.for_role("producer").redis_url == "redis://p:s%40cret@h:1/0"
    assert settings.for_role("worker").redis_url == "redis://:admin@h:1/0"
    sentinels = RunSettings(
        redis_url="sentinel://:pw@s1:1;sentinel://s2:2/0?master_name=m", redis_trainer_auth="t:x"
    )
    address = RedisAddress.parse(sentinels.for_role("trainer").redis_url)
    assert (address.username, address.password, address.master_name) == ("t", "x", "m")
