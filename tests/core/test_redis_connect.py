"""Redis URLs name one server, a Sentinel-watched master or a Cluster; malformed ones fail in one line, and
passwords never show in what is logged."""

from __future__ import annotations

import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from mergebroker.broker.cluster.partition import Keys
from mergebroker.broker.engine.limits.ratelimit import RateLimiter
from mergebroker.broker.engine.limits.redis_limiter import RedisRateLimiter
from mergebroker.clock import FakeClock
from mergebroker.redis_connect import PoolOptions, RedisTarget, connect, has_hash_tag, parse_redis_url, redacted


def test_single_server_urls_pass_through() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://h:6380", "unix:///tmp/redis.sock?db=2"):
        assert parse_redis_url(url) == RedisTarget("single", url)


def test_sentinel_url_names_the_sentinels_service_db_and_passwords() -> None:
    target = parse_redis_url("redis+sentinel://:s3cret@10.0.0.1:26380,10.0.0.2/mb/3?sentinel_password=sp")
    assert target.kind == "sentinel"
    assert target.nodes == (("10.0.0.1", 26380), ("10.0.0.2", 26379))  # the sentinel port by default
    assert (target.service_name, target.db) == ("mb", 3)
    assert (target.username, target.password, target.sentinel_password) == (None, "s3cret", "sp")


def test_sentinel_url_without_db_uses_db_0_and_reads_a_username() -> None:
    target = parse_redis_url("redis+sentinel://app:p%40ss@h:1/mymaster")
    assert (target.db, target.username, target.password) == (0, "app", "p@ss")


def test_cluster_url_names_its_seed_nodes() -> None:
    target = parse_redis_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001,[::1]:7002")
    assert target.kind == "cluster"
    assert target.nodes == (("127.0.0.1", 7000), ("127.0.0.1", 7001), ("::1", 7002))


@pytest.mark.parametrize("url, complaint", [
    ("http://h:6379", "the scheme must be"),
    ("h:6379", "the scheme must be"),
    ("redis+sentinel://h:1", "the path must be /<service_name>[/<db>]"),
    ("redis+sentinel://h:1/mb/0/extra", "the path must be"),
    ("redis+sentinel://h:1/mb/x", "db 'x' is not a number"),
    ("redis+sentinel://h:port/mb", "port 'port' is not a number"),
    ("redis+sentinel://h:1,/mb", "every node needs a host"),
    ("redis+sentinel://h:1/mb?password=x", "unknown parameter(s) password"),
    ("redis+cluster://", "every node needs a host"),
    ("redis+cluster://h:1/2", "database 0 only"),
    ("redis+cluster://h:1?sentinel_password=x", "unknown parameter(s) sentinel_password"),
    ("redis+cluster://[::1:7000", "Invalid IPv6 URL"),
])
def test_malformed_urls_fail_in_one_line_without_the_password(url: str, complaint: str) -> None:
    secret_url = url.replace("://", "://:hunter2@", 1) if "://" in url else url
    with pytest.raises(ValueError) as caught:
        parse_redis_url(secret_url)
    message = str(caught.value)
    assert complaint in message and "\n" not in message
    assert "hunter2" not in message


@pytest.mark.parametrize("url, shown", [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://user:pw@h:6379/0", "redis://user:***@h:6379/0"),
    ("redis://user@h:6379/0", "redis://user@h:6379/0"),
    ("redis+sentinel://:p@w@a:1,b:2/mb?sentinel_password=sp&x=1", "redis+sentinel://:***@a:1,b:2/mb?sentinel_password=***&x=1"),
    ("redis://h/0?password=pw", "redis://h/0?password=***"),
    ("redis+cluster://h:1,h:2", "redis+cluster://h:1,h:2"),
    ("not a url", "not a url"),
])
def test_redacted_hides_every_password(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_hash_tags_follow_redis_clusters_rule() -> None:
    assert has_hash_tag("{mb:rl}:tier:a") and has_hash_tag("x{t}y")
    assert not has_hash_tag("mb:rl:tier:a") and not has_hash_tag("{}{t}") and not has_hash_tag("{open")


def test_cluster_keys_share_one_hash_tag() -> None:
    keys = Keys("mb:cluster")
    names = [keys.jobs("standard", 3), keys.lease(3), keys.replies("f"), keys.presence, keys.workers,
             keys.sent(keys.jobs("batch", 1), b"1-0")]
    assert all(name.startswith("{mb:cluster}:") for name in names)
    assert Keys("{own}:c").lease(1) == "{own}:c:lease:1"  # a prefix holding a tag is kept


def test_the_limiter_refuses_a_prefix_without_a_hash_tag() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="hash tag"):
        RedisRateLimiter(connect("redis://127.0.0.1:1"), prefix="mb:rl:", fallback=RateLimiter(clock), clock=clock)


async def test_each_kind_builds_its_client_with_the_callers_pool() -> None:
    """Nothing connects: the clients are built, inspected and closed."""
    blocking = connect("redis://127.0.0.1:1/0", PoolOptions(max_connections=7, pool_timeout_s=0.5))
    assert isinstance(blocking.connection_pool, BlockingConnectionPool)
    assert blocking.connection_pool.max_connections == 7
    sentinel = connect("redis+sentinel://:pw@127.0.0.1:1/mb/2",
                       PoolOptions(max_connections=5, pool_timeout_s=0.5, client_name="w1"))
    assert isinstance(sentinel, Redis)
    pool = sentinel.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and isinstance(pool, BlockingConnectionPool)
    assert pool.max_connections == 5 and pool.service_name == "mb"
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"],
            pool.connection_kwargs["client_name"]) == (2, "pw", "w1")
    single = connect("redis+sentinel://127.0.0.1:1/mb", PoolOptions(single_connection_client=True))
    # One connection, taken from a pool of one on each command: the pool's checkout asks Sentinel where the
    # master is (test_redis_topologies has it follow a failover).
    assert single.connection_pool.max_connections == 1 and not single.single_connection_client
    cluster = connect("redis+cluster://127.0.0.1:1", PoolOptions(max_connections=3, pool_timeout_s=0.5))
    assert isinstance(cluster, RedisCluster)
    for client in (blocking, sentinel, single, cluster):
        await client.aclose()


class _UnmarkedTransport:
    """A transport closed under the writer before it says so (redis-py 8.2 checks `is_closing()` first)."""

    def is_closing(self) -> bool:
        return False


class _ClosedWriter:
    """A stream writer over a transport the loop closed, as uvloop reports a write to it."""

    transport = _UnmarkedTransport()

    def writelines(self, _data: object) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None

    async def wait_closed(self) -> None:
        return None


async def test_a_write_to_a_closed_transport_is_a_connection_error_not_a_crash():
    """What ended a cluster front-end's reply loop when Redis was killed: uvloop's RuntimeError on a closed
    transport. Every plain client's connections raise redis' ConnectionError for it, which owners handle."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    for url in ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0", "unix:///tmp/nothing.sock"):
        client = connect(url)
        connection = client.connection_pool.make_connection()
        connection._reader, connection._writer = object(), _ClosedWriter()  # connected, to a dead transport
        connection.socket_timeout = None
        with pytest.raises(RedisConnectionError):
            await connection.send_packed_command(b"PING\r\n", check_health=False)
        await client.aclose()
