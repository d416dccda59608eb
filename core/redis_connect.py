"""One place that turns a Redis URL into a redis-py asyncio client: one server, Sentinel or Cluster.

- `redis://`, `rediss://`, `unix://`: one server, exactly as `redis.asyncio` reads these URLs.
- `redis+sentinel://[[user]:password@]host:port[,host:port...]/<service>[/<db>][?sentinel_password=...]`:
  the master Sentinel names for `service`; every new connection asks the sentinels where the master is,
  so after a failover the next connection (a reconnect on error, through the caller's retry) reaches the
  new one. The userinfo password is the master's, `sentinel_password` the sentinels'.
- `redis+cluster://[[user]:password@]host:port[,host:port...]`: a Redis Cluster found from those nodes.
  A multi-key command or script must keep its keys in one slot (hash tags, `{tag}`): each owner says how.

The caller's pool options (`PoolOptions`) mean the same for every kind. Parsing (`parse_redis_url`) is
pure and raises `ValueError` with one line naming the URL `redacted`: passwords never reach a log.
"""

from __future__ import annotations

import asyncio
import contextvars
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException

RedisClient = Redis | RedisCluster
"""What `connect` returns: both speak the same commands; a cluster routes each by its key's slot."""

SENTINEL_PORT = 26379
REDIS_PORT = 6379
SINGLE_WAIT_S = 5.0  # how long a single-connection client's second caller waits for the connection (Sentinel)
_SECRET_PARAMS = ("password", "sentinel_password")


@dataclass(frozen=True)
class PoolOptions:
    """How a caller wants its connections; None leaves redis-py's default.

    `pool_timeout_s` set: callers past `max_connections` wait that long for a free connection (a blocking
    pool), then get a `ConnectionError`; unset, the pool raises at once as redis-py's default pool does
    (a cluster client always waits: without bound when unset, see `_WaitingCluster`).
    """

    max_connections: int | None = None
    pool_timeout_s: float | None = None
    socket_timeout_s: float | None = None
    socket_connect_timeout_s: float | None = None
    retry: Retry | None = None
    client_name: str | None = None
    single_connection_client: bool = False
    decode_responses: bool = False


@dataclass(frozen=True)
class RedisTarget:
    """A parsed URL: which topology, its nodes (sentinels or cluster seeds) and credentials."""

    kind: Literal["single", "sentinel", "cluster"]
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service_name: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def redacted(url: str) -> str:
    """`url` with every password replaced by `***` (userinfo and `password`/`sentinel_password` params)."""
    def userinfo(match: re.Match[str]) -> str:
        user, sep, _secret = match.group(2).partition(":")
        return f"{match.group(1)}{user}{sep}{'***' if sep else ''}@"

    hidden = re.sub(r"(//)([^/?#]*)@", userinfo, url, count=1)  # up to the last @: a raw @ in a password
    params = "|".join(_SECRET_PARAMS)
    return re.sub(rf"([?&](?:{params})=)[^&#]*", r"\1***", hidden)


def parse_redis_url(url: str) -> RedisTarget:
    """What `url` names (see the module docstring); `ValueError` (one line) when it is malformed."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss", "unix"):
        return RedisTarget("single", url)
    if scheme not in ("redis+sentinel", "redis+cluster"):
        raise ValueError(f"redis URL {redacted(url)!r}: the scheme must be redis, rediss, unix, "
                         "redis+sentinel or redis+cluster")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ValueError(f"redis URL {redacted(url)!r}: {exc}") from None
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    allowed = {"sentinel_password"} if scheme == "redis+sentinel" else set()
    unknown = sorted(set(query) - allowed)
    if unknown:
        raise ValueError(f"redis URL {redacted(url)!r}: unknown parameter(s) {', '.join(unknown)}")
    default_port = SENTINEL_PORT if scheme == "redis+sentinel" else REDIS_PORT
    nodes = tuple(_node(url, h, default_port) for h in hosts.split(","))
    path = [unquote(p) for p in parts.path.split("/") if p]
    common: dict[str, Any] = {"url": url, "nodes": nodes, "username": unquote(username) or None,
                              "password": unquote(password) or None}
    if scheme == "redis+cluster":
        if path and path != ["0"]:
            raise ValueError(f"redis URL {redacted(url)!r}: a Redis Cluster has database 0 only")
        return RedisTarget("cluster", **common)
    if not path or len(path) > 2:
        raise ValueError(f"redis URL {redacted(url)!r}: the path must be /<service_name>[/<db>]")
    return RedisTarget("sentinel", service_name=path[0], db=_int(url, path[1], "db") if len(path) == 2 else 0,
                       sentinel_password=query.get("sentinel_password") or None, **common)


def _node(url: str, text: str, default_port: int) -> tuple[str, int]:
    host, colon, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not colon:
        host, port = text, str(default_port)
    host = host.strip("[]")
    if not host:
        raise ValueError(f"redis URL {redacted(url)!r}: every node needs a host (host:port, comma-separated)")
    return host, _int(url, port, "port")


def _int(url: str, text: str, what: str) -> int:
    if not text.isdigit():
        raise ValueError(f"redis URL {redacted(url)!r}: {what} {text!r} is not a number")
    return int(text)


def connect(url: str, options: PoolOptions = PoolOptions()) -> RedisClient:
    """A client for `url` with `options`; nothing connects until the first command."""
    target = parse_redis_url(url)
    if target.kind == "sentinel":
        return _sentinel_client(target, options)
    if target.kind == "cluster":
        return _cluster_client(target, options)
    kwargs = _connection_kwargs(options)
    if options.single_connection_client:
        client: Redis = Redis.from_url(url, single_connection_client=True, **_with_max(kwargs, options))
    elif options.pool_timeout_s is not None:
        pool = BlockingConnectionPool.from_url(url, timeout=options.pool_timeout_s, **_with_max(kwargs, options))
        client = Redis.from_pool(pool)
    else:
        client = Redis.from_url(url, **_with_max(kwargs, options))
    # `from_url` picks the connection class by scheme; ours is that class with writes to closed transports mapped.
    client.connection_pool.connection_class = _MAPPED_CONNECTIONS[urlsplit(url).scheme.lower()]
    return client


class _ClosedTransportMapped:
    """A connection whose write to a transport the event loop already closed raises `ConnectionError`.

    uvloop raises `RuntimeError("unable to perform operation on <TCPTransport closed=True ...>")` there where
    asyncio's own loop raises `OSError`, which redis-py maps; unmapped, it escaped every owner's `RedisError`
    handling when Redis was killed mid-write, and ended a cluster front-end's reply loop for good. Mapped, it
    is the connection error it is: retried once on a new connection, then handled as Redis being away.
    """

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except RuntimeError as exc:
            raise RedisConnectionError(f"Error writing to a closed connection: {exc}") from exc


class _MappedConnection(_ClosedTransportMapped, Connection):
    pass


class _MappedSSLConnection(_ClosedTransportMapped, SSLConnection):
    pass


class _MappedUnixConnection(_ClosedTransportMapped, UnixDomainSocketConnection):
    pass


_MAPPED_CONNECTIONS: dict[str, type[Connection] | type[UnixDomainSocketConnection]] = {
    "redis": _MappedConnection, "rediss": _MappedSSLConnection, "unix": _MappedUnixConnection}
"""The connection class for each plain URL scheme (what redis-py's `from_url` would pick, mapped)."""


def has_hash_tag(key: str) -> bool:
    """Whether Redis Cluster hashes `key` by a `{tag}` in it (the first `{` followed by a non-empty `...}`)."""
    start = key.find("{")
    return start >= 0 and key.find("}", start + 1) > start + 1


async def get_many(client: RedisClient, keys: Sequence[str]) -> list[Any]:
    """The values of `keys`: one MGET on one server, one MGET per slot in a cluster (then not atomic)."""
    if isinstance(client, RedisCluster):
        with _as_redis_error():
            await client.initialize()  # the slot map, which splitting the keys by node needs
            return list(await client.mget_nonatomic(list(keys)))
    return list(await client.mget(list(keys)))


async def routed_to(client: RedisClient, key: str) -> dict[str, Any]:
    """Keyword arguments that send a server command (`CLIENT ID`, `CLIENT LIST`, `TIME`) to the node that
    serves `key`: in a cluster redis-py sends those to an arbitrary node; on one server, nothing to add."""
    if not isinstance(client, RedisCluster):
        return {}
    with _as_redis_error():
        await client.initialize()  # the slot map; a no-op once known
        return {"target_nodes": client.get_node_from_key(key)}


async def drop_connections(client: RedisClient) -> None:
    """Close every idle pooled connection (the next command opens a fresh one): after an outage they are
    stale. A cluster client keeps a pool per node, and finds its nodes again on the next command's error."""
    if isinstance(client, RedisCluster):
        for node in client.get_nodes():
            await node.disconnect()
        return
    await client.connection_pool.disconnect()


def _connection_kwargs(options: PoolOptions) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"decode_responses": options.decode_responses}
    for name, value in (("socket_timeout", options.socket_timeout_s),
                        ("socket_connect_timeout", options.socket_connect_timeout_s),
                        ("retry", options.retry), ("client_name", options.client_name)):
        if value is not None:
            kwargs[name] = value
    return kwargs


def _with_max(kwargs: dict[str, Any], options: PoolOptions) -> dict[str, Any]:
    return kwargs if options.max_connections is None else {**kwargs, "max_connections": options.max_connections}


class _SentinelPool(SentinelConnectionPool):
    """A pool of connections to the current master that closes its own `Sentinel` when it closes."""

    def __init__(self, service_name: str, sentinel: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel, **kwargs)  # type: ignore[no-untyped-call]  # redis-py: untyped

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            await self.sentinel_manager.aclose()


class _BlockingSentinelPool(_SentinelPool, BlockingConnectionPool):
    """The same, whose callers wait for a free connection as `BlockingConnectionPool`'s do."""


def _sentinel_client(target: RedisTarget, options: PoolOptions) -> Redis:
    service = target.service_name
    assert service is not None, "parse_redis_url names the service of every sentinel URL"
    kwargs = _connection_kwargs(options)
    # Sentinels answer "where is the master?" only: short socket options and their own password.
    sentinel_kwargs: dict[str, Any] = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    if target.sentinel_password:
        sentinel_kwargs["password"] = target.sentinel_password
    # redis-py types this constructor from 8.2 on and left it untyped before: called as Any, it checks on both.
    make_sentinel: Any = Sentinel
    sentinel = make_sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)
    kwargs.update(db=target.db, username=target.username, password=target.password, is_master=True)
    pool: SentinelConnectionPool
    if options.single_connection_client:
        # A pool of one instead: redis-py's single-connection client reconnects on its send path, which skips
        # the Sentinel lookup and dials the address it had, so after a failover it called the dead master
        # forever (redis-py 8.2). Taking the connection from the pool each time looks the master up.
        pool = _BlockingSentinelPool(service, sentinel, timeout=options.pool_timeout_s or SINGLE_WAIT_S,
                                     **{**kwargs, "max_connections": 1})
    elif options.pool_timeout_s is not None:
        pool = _BlockingSentinelPool(service, sentinel, timeout=options.pool_timeout_s,
                                     **_with_max(kwargs, options))
    else:
        pool = _SentinelPool(service, sentinel, **_with_max(kwargs, options))
    client = Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # as `from_pool`: the client owns its pool (and its Sentinel)
    return client


def _cluster_client(target: RedisTarget, options: PoolOptions) -> RedisCluster:
    kwargs = _connection_kwargs(options)
    kwargs.update(username=target.username, password=target.password)
    nodes = [ClusterNode(host, port) for host, port in target.nodes]
    max_connections = options.max_connections or 100
    if options.single_connection_client:
        max_connections = 1  # per node: the caller's sequential commands to one node share one connection
    return _WaitingCluster(startup_nodes=nodes, max_connections=max_connections,
                           pool_timeout_s=options.pool_timeout_s, **kwargs)


_HOLDING: contextvars.ContextVar[bool] = contextvars.ContextVar("redis_cluster_holding", default=False)


class _WaitingCluster(RedisCluster):
    """A `RedisCluster` whose callers wait for a free connection, as a `BlockingConnectionPool`'s do.

    redis-py's cluster raises `MaxConnectionsError` at once when a node's connections are all busy; under a
    burst that would read as "Redis is down" and switch callers to their fallbacks. Here at most
    `max_connections` commands (or pipelines) run at a time, so no node ever needs more, and the others
    wait up to `pool_timeout_s`. Its pipelines also load the scripts queued on them, as plain pipelines do.
    """

    def __init__(self, *, pool_timeout_s: float | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._free = asyncio.Semaphore(int(kwargs["max_connections"]))
        self._pool_timeout_s = pool_timeout_s
        self.loaded_scripts: set[str] = set()
        self._scripts_loaded_on: frozenset[str] = frozenset()  # the primaries `loaded_scripts` holds for

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the connections for a command (re-entrant within a task: a retried redirect)."""
        if _HOLDING.get():
            yield
            return
        # The slot map first, for all waiting callers at once: commands that race redis-py's own first
        # initialisation were seen to fail ("Connection closed by server") on a freshly made cluster client.
        await self.initialize()
        try:
            async with asyncio.timeout(self._pool_timeout_s):
                await self._free.acquire()
        except TimeoutError as exc:
            raise RedisConnectionError("No connection available.") from exc
        token = _HOLDING.set(True)
        try:
            yield
        finally:
            _HOLDING.reset(token)
            self._free.release()

    def forget_scripts_of_past_primaries(self) -> None:
        """A promoted replica or a new shard has none of the scripts loaded on the old primaries: once the
        primaries differ from those `loaded_scripts` were loaded on, each is loaded again before its first use
        (rather than failing once with NoScriptError, which costs a worker its leases' round after a failover)."""
        primaries = frozenset(node.name for node in self.get_primaries())
        if primaries != self._scripts_loaded_on:
            self.loaded_scripts.clear()
            self._scripts_loaded_on = primaries

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        with _as_redis_error():  # pipelines, `get_many` and `routed_to` start here too
            return await super().initialize(*args, **kwargs)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with _as_redis_error():
            async with self.slot():
                return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # raises, as redis-py does
        return _WaitingPipeline(self, transaction)  # type: ignore[abstract]  # as redis-py's own `pipeline`


class _WaitingPipeline(ClusterPipeline):
    """A cluster pipeline that waits for a connection and loads its scripts (`pipe.scripts.add(script)`)."""

    def __init__(self, client: _WaitingCluster, transaction: bool | None = None) -> None:
        super().__init__(client, transaction)
        self.scripts: set[Any] = set()
        self._waiting = client

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> ClusterPipeline:
        """Queue a script by its SHA (redis-py blocks this on cluster pipelines; it routes by the script's keys,
        which must share a slot, and `execute` loads the scripts added to `scripts` first)."""
        return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        with _as_redis_error():
            results = await self._execute(allow_redirections)
        if any(isinstance(r, NoScriptError) for r in results):
            self._waiting.loaded_scripts.clear()  # a node lost them (a restart, a failover): load them again
        if raise_on_error:
            for result in results:
                if isinstance(result, Exception):
                    raise result
        return results

    async def _execute(self, allow_redirections: bool) -> list[Any]:
        async with self._waiting.slot():
            self._waiting.forget_scripts_of_past_primaries()
            for script in self.scripts:
                if script.sha not in self._waiting.loaded_scripts:
                    await self._waiting.script_load(script.script)  # on every primary
                    self._waiting.loaded_scripts.add(script.sha)
            self.scripts = set()
            return await super().execute(raise_on_error=False, allow_redirections=allow_redirections)


@contextmanager
def _as_redis_error() -> Iterator[None]:
    """redis-py's cluster raises `RedisClusterException` (not a `RedisError`) when no node answers: every
    owner here treats `RedisError` as "Redis is away", so it leaves as the `ConnectionError` it means."""
    try:
        yield
    except RedisClusterException as exc:
        raise RedisConnectionError(f"Redis Cluster unreachable: {exc}") from exc
