"""Everything Redis holds works behind Sentinel and on a Redis Cluster, configured by URL alone: a master
killed mid-traffic costs the components nothing (they degrade, then follow the new master), and on a
cluster no multi-key command or script crosses a slot."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.exceptions import RedisError

from mergebroker.breaker.circuit import BreakerState, CircuitBreaker
from mergebroker.breaker.shared_state import SharedBreakerState
from mergebroker.broker.cluster.claims import Claimer
from mergebroker.broker.cluster.leases import PartitionLeases
from mergebroker.broker.cluster.markers import SentMarkers
from mergebroker.broker.cluster.presence import Presence, absent_workers, make_presence_client
from mergebroker.broker.cluster.server_time import ServerClock
from mergebroker.broker.engine.ground.response_store import RedisResponseStore
from mergebroker.broker.engine.limits.ratelimit import LimitSpec, RateLimiter
from mergebroker.broker.engine.limits.redis_limiter import RedisRateLimiter
from mergebroker.clock import FakeClock, monotonic
from mergebroker.errors import Overloaded, RateLimited
from mergebroker.merge.redis_cache import RedisCache, make_redis_client
from mergebroker.redis_connect import RedisClient
from tests.breaker.test_breaker_shared import SETTINGS as BREAKER_SETTINGS
from tests.broker.cluster.test_cluster_streams import KEYS, SETTINGS, Node, answer, chat_job, next_job
from tests.conftest import free_port, provider_for
from tests.helpers.polling import wait_until, wait_until_blocking

pytestmark = pytest.mark.redis

SERVER = shutil.which("redis-server")
CLI = shutil.which("redis-cli")
needs_binaries = pytest.mark.skipif(SERVER is None or CLI is None, reason="needs redis-server and redis-cli")
FAILOVER_S = 20.0
# A master starts a replica's first sync at once, instead of waiting 5 s (Redis 7's default) for more replicas.
QUICK_SYNC = ("--repl-diskless-sync-delay", "0")


def cli(port: int, *args: str) -> str:
    """`redis-cli -p port args...`'s output ('' when the server does not answer)."""
    assert CLI is not None
    done = subprocess.run([CLI, "-p", str(port), *args], capture_output=True, text=True, timeout=5)
    return done.stdout if done.returncode == 0 else ""


def cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher) is free too, so at most 55535."""
    while True:
        port = free_port()
        if port <= 55535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


class Processes:
    """redis-server processes on loopback ports under one temporary folder, all stopped at the end."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mb-topology-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, port: int, *args: str, conf: str | None = None) -> None:
        assert SERVER is not None
        command = [SERVER] + ([conf] if conf else []) + [
            "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir),
            *args]
        log = self.dir / f"{port}.log"
        with log.open("wb") as out:
            proc = self.procs[port] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

        def answers() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"redis-server on {port} exited: {log.read_text(errors='replace')[-2000:]}")
            return cli(port, "PING").strip() == "PONG"
        wait_until_blocking(answers, 10, f"redis-server on {port} never answered")

    def kill(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs.pop(port).wait(timeout=5)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(timeout=5)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelSet:
    """A master, its replica and three sentinels watching them as service `mb`."""

    def __init__(self, processes: Processes) -> None:
        self.processes = processes
        self.master, self.replica = free_port(), free_port()
        self.sentinels = [free_port() for _ in range(3)]

    def start(self) -> None:
        self.processes.start(self.master, *QUICK_SYNC)
        self.processes.start(self.replica, "--replicaof", "127.0.0.1", str(self.master), *QUICK_SYNC)
        # A sentinel learns the replica from the master's INFO when it connects: the replica must be linked first.
        wait_until_blocking(lambda: "master_link_status:up" in cli(self.replica, "INFO", "replication"), 30,
                            "the replica never linked to the master")
        for port in self.sentinels:
            conf = self.processes.dir / f"sentinel-{port}.conf"  # each its own: a sentinel rewrites its file
            conf.write_text(f"sentinel monitor mb 127.0.0.1 {self.master} 2\n"
                            "sentinel down-after-milliseconds mb 1000\nsentinel failover-timeout mb 3000\n")
            self.processes.start(port, "--sentinel", conf=str(conf))
        # A failover needs the sentinels to know the replica and each other (hello messages every 2 s).
        wait_until_blocking(self._ready, 15, "the sentinels never found the replica and each other")

    def _ready(self) -> bool:
        def known(port: int, what: str) -> int:  # entries listed: each has an "ip" field
            return cli(port, "SENTINEL", what, "mb").split("\n").count("ip")
        return all(known(p, "REPLICAS") >= 1 and known(p, "SENTINELS") >= 2 for p in self.sentinels)

    def master_port(self) -> int:
        reply = cli(self.sentinels[0], "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mb").split()
        return int(reply[1]) if len(reply) == 2 else 0

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinels) + "/mb"


@pytest.fixture
def processes() -> Iterator[Processes]:
    running = Processes()
    yield running
    running.stop_all()


@pytest.fixture
def sentinel_set(processes: Processes) -> SentinelSet:
    if SERVER is None or CLI is None:
        pytest.skip("needs redis-server and redis-cli")
    watched = SentinelSet(processes)
    watched.start()
    return watched


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    """Three masters, no replicas, every slot assigned: `redis+cluster://` to all three."""
    if SERVER is None or CLI is None:
        pytest.skip("needs redis-server and redis-cli")
    running = Processes()
    try:
        ports = started_cluster(running, replicas=0, node_timeout_ms=2000)
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        running.stop_all()


@pytest.fixture
async def cluster_client(cluster_url: str) -> AsyncIterator[RedisClient]:
    client = make_redis_client(cluster_url)
    yield client
    await client.aclose()


def limiter(client: RedisClient, clock=monotonic, retry_after_s: float = 5.0) -> RedisRateLimiter:
    return RedisRateLimiter(client, fallback=RateLimiter(clock), clock=clock, retry_after_s=retry_after_s)


async def admitted(lim: RedisRateLimiter, specs: list[LimitSpec], n: int) -> int:
    count = 0
    for _ in range(n):
        try:
            await lim.reserve(specs, 1)
            count += 1
        except RateLimited:
            pass
    return count


# Sentinel


@needs_binaries
async def test_a_sentinel_failover_costs_the_components_nothing(sentinel_set: SentinelSet) -> None:
    """Cache, limiter and stored responses keep working through a SIGKILLed master and follow the new one."""
    client, other = make_redis_client(sentinel_set.url), make_redis_client(sentinel_set.url)
    cache = RedisCache(client, prefix="c:", ttl_s=60, retry_after_s=0.2)
    lim, lim2 = limiter(client, retry_after_s=0.2), limiter(other, retry_after_s=0.2)
    store = RedisResponseStore(client)
    roomy = [LimitSpec("tier:loop", rpm=1_000_000, tpm=None)]
    unavailable = 0

    async def one_round(i: int) -> bool:
        """One of everything; True when every part reached Redis."""
        nonlocal unavailable
        await cache.set(f"k{i}", b"v")
        hit = await cache.get(f"k{i}") == b"v"
        await lim.reserve(roomy, 1)  # never refused: a dead Redis means the local fallback
        store.keep("t", {"id": f"resp_{i}", "output": []}, [], None)
        try:
            stored = await store.get("t", f"resp_{i}") is not None
        except Overloaded:  # designed: reads of the store say "try again" while Redis is away
            unavailable += 1
            stored = False
        return hit and stored and lim._down_until is None

    try:
        for i in range(20):
            assert await one_round(i)
        sentinel_set.processes.kill(sentinel_set.master)
        rounds = iter(range(20, 100_000))
        assert not await one_round(next(rounds))  # the master is gone: every part degrades, none raises
        # Within FAILOVER_S of real time (the servers' own failover), or `wait_until` fails the test.
        await wait_until(lambda: one_round(next(rounds)), FAILOVER_S, "the components never reached the new master",
                         interval_s=0.05)
        assert sentinel_set.master_port() == sentinel_set.replica
        for i in range(10):  # steady again
            assert await one_round(100_000 + i)
        # Limits are shared again, not per replica: two limiters on two clients admit 5 of a 5-rpm limit.
        tight = [LimitSpec("tier:after", rpm=5, tpm=None)]
        assert await admitted(lim, tight, 3) + await admitted(lim2, tight, 3) == 5
    finally:
        await store.close()
        await client.aclose()
        await other.aclose()


@needs_binaries
async def test_a_workers_presence_connection_follows_a_sentinel_failover_to_the_new_master(
        sentinel_set: SentinelSet) -> None:
    """The one named connection that says a worker is alive reconnects to the promoted replica and registers
    there: a presence stuck on the dead master reads as an outage every period (the worker fencing its jobs
    each time) and, to the others, as a dead worker."""
    client = make_redis_client(sentinel_set.url)
    presence = Presence(make_presence_client(sentinel_set.url, "w1"), KEYS, "w1")
    try:
        await presence.refresh()
        sentinel_set.processes.kill(sentinel_set.master)
        await wait_until(lambda: sentinel_set.master_port() == sentinel_set.replica, FAILOVER_S,
                         "the sentinels never promoted the replica", interval_s=0.1)

        async def registered_there() -> bool:
            try:
                await presence.refresh()
            except RedisError:
                return False
            return await absent_workers(client, KEYS, me="") == set()

        await wait_until(registered_there, FAILOVER_S, "the presence connection never reached the new master",
                         interval_s=0.1)
        names = [c.get("name") for c in await client.client_list()]
        assert "w1" in names  # on the new master, under its name
    finally:
        await presence.aclose()
        await client.aclose()


@needs_binaries
async def test_no_request_is_lost_through_a_broker_during_a_failover(sentinel_set: SentinelSet, simulator,
                                                                     start_broker) -> None:
    """Requests sent all through the failover all get 200: Redis is shared state, never the request path."""
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"},
                                 "tiers": [{"name": "standard", "window_ms": 0, "rpm": 1_000_000}],
                                 "redis": {"url": sentinel_set.url}})
    statuses: list[int] = []
    stop = asyncio.Event()

    async def sender(n: int) -> None:
        i = 0
        while not stop.is_set():
            status, _body, _headers = await broker.chat(f"question {n}-{i}")
            statuses.append(status)
            i += 1

    senders = [asyncio.create_task(sender(n)) for n in range(4)]
    try:
        await wait_until(lambda: len(statuses) >= 20, 10, "no requests got through before the failover")
        sentinel_set.processes.kill(sentinel_set.master)
        killed = len(statuses)
        await wait_until(lambda: sentinel_set.master_port() == sentinel_set.replica, FAILOVER_S,
                         "the sentinels never promoted the replica", interval_s=0.1)
        after = len(statuses)
        assert after > killed  # requests were answered while there was no master at all
        await wait_until(lambda: len(statuses) >= after + 20, 10, "no requests got through after the failover")
    finally:
        stop.set()
        await asyncio.gather(*senders)
    assert statuses and set(statuses) == {200}, f"{len([s for s in statuses if s != 200])} lost"


# Cluster


@needs_binaries
async def test_the_cache_spreads_over_the_cluster(cluster_client: RedisClient) -> None:
    cache = RedisCache(cluster_client, prefix="topo:c:", ttl_s=60)
    items = {f"key-{i}": f"value-{i}".encode() for i in range(50)}  # many slots, all three nodes
    await cache.set_many(items)
    assert await cache.get_many(list(items)) == list(items.values())
    assert await cache.get("missing") is None and cache.available


@needs_binaries
async def test_the_limiters_script_runs_on_the_cluster(cluster_url: str) -> None:
    """A request's tier and key buckets share the limiter's hash tag: one script call, shared by replicas."""
    a, b = make_redis_client(cluster_url), make_redis_client(cluster_url)
    try:
        specs = [LimitSpec("tier:topo", rpm=5, tpm=1000), LimitSpec("key:k1", rpm=100, tpm=None)]
        first, second = limiter(a), limiter(b)
        assert await admitted(first, specs, 3) + await admitted(second, specs, 3) == 5
        assert first._down_until is None and second._down_until is None  # Redis answered, no fallback
        reservation = await first.reserve([LimitSpec("tier:tokens", rpm=None, tpm=1000)], 800)
        await reservation.settle(100)
        probe = await second.reserve([LimitSpec("tier:tokens", rpm=None, tpm=1000)], 0)
        assert probe.headers()["x-ratelimit-remaining-tokens"] == "900"
    finally:
        await a.aclose()
        await b.aclose()


@needs_binaries
async def test_shared_breaker_state_works_on_the_cluster(cluster_url: str) -> None:
    a, b = make_redis_client(cluster_url), make_redis_client(cluster_url)
    clock = FakeClock()
    try:
        names = ["alpha", "beta", "gamma", "delta"]  # their keys fall in different slots
        mine = {n: CircuitBreaker(n, BREAKER_SETTINGS, clock=clock) for n in names}
        theirs = {n: CircuitBreaker(n, BREAKER_SETTINGS, clock=clock) for n in names}
        one, two = SharedBreakerState(a, clock=clock), SharedBreakerState(b, clock=clock)
        for n in names:
            one.attach(mine[n])
            two.attach(theirs[n])
        for n in ("beta", "delta"):
            for _ in range(BREAKER_SETTINGS.min_calls):
                mine[n].record_failure()
        await one.refresh()
        await two.refresh()
        assert {n for n, br in theirs.items() if br.state is BreakerState.OPEN} == {"beta", "delta"}
        assert not two._unavailable
    finally:
        await a.aclose()
        await b.aclose()


@needs_binaries
async def test_stored_responses_work_on_the_cluster(cluster_client: RedisClient) -> None:
    store = RedisResponseStore(cluster_client, retention_s=60)
    for i in range(10):
        store.keep(f"tenant{i}", {"id": f"resp_{i}", "output": []}, [{"role": "user", "content": str(i)}], None)
    for i in range(10):
        stored = await store.get(f"tenant{i}", f"resp_{i}")
        assert stored is not None and stored.input_items == [{"role": "user", "content": str(i)}]
    assert await store.get("tenant0", "resp_1") is None  # another tenant's
    assert await store.delete("tenant3", "resp_3") and await store.get("tenant3", "resp_3") is None
    await store.close()


@needs_binaries
async def test_cluster_mode_runs_on_one_slot_of_the_cluster(cluster_url: str) -> None:
    """Streams, leases, markers and presence of cluster mode: a job's round trip, scripts and all."""
    from mergebroker.broker.cluster.client import make_stream_client
    from mergebroker.broker.cluster.frontend import ClusterQueue
    from mergebroker.broker.engine.chat.job_queue import FakeJobQueue
    from mergebroker.broker.engine.ground.metrics import Metrics

    redis = make_stream_client(cluster_url, block_ms=SETTINGS.block_ms)
    presence_client = make_presence_client(cluster_url, "w1")
    fe = ClusterQueue(redis, FakeJobQueue(), keys=KEYS, settings=SETTINGS, partitions=SETTINGS.partitions,
                      server_clock=ServerClock(), metrics=Metrics(), frontend_id="f1")
    fe.start()
    try:
        node = Node(redis, "w1", FakeClock())
        await node.leases.renew()  # the renewal script and the live set, in one cluster pipeline
        assert node.leases.owned == frozenset(range(SETTINGS.partitions))
        future = fe.submit(chat_job("hello"))
        await node.read_jobs()  # one XREADGROUP over every partition stream
        job = await next_job(node.queue)
        holds = node.consumer._held
        held = [h for key in list(holds) if (h := holds.get(key)) is not None]
        marked = await SentMarkers(redis, KEYS, "w1").mark(held)  # a script reaching keys it derives
        assert len(marked) == len(held) == 1
        await holds.heartbeat(redis, node.consumer._heartbeat, "w1")  # scripts queued on a cluster pipeline
        assert not any(h.lost for h in held)  # still its own: the script ran and kept them
        answer(job, "hi there")
        await node.write()
        assert (await asyncio.wait_for(future, 10)).body["choices"][0]["message"]["content"] == "hi there"

        orphan = fe.submit(chat_job("orphan"))
        orphan.add_done_callback(lambda f: f.cancelled() or f.exception())  # it fails at the stop: read here
        await node.read_jobs()
        streams = [KEYS.jobs("batch", p) for p in range(SETTINGS.partitions)]
        stream = [s for s in streams if await redis.xlen(s)][0]
        claimer = Claimer(redis, KEYS, "w2", claim_idle_ms=SETTINGS.claim_idle_ms)
        pending = (await claimer.scan([stream], dead={"w1"}, count=10))[stream]
        taken = await claimer.claim(stream, claimer.plan(pending, held=set(), dead={"w1"}, room=10))
        assert len(taken) == 1  # the claim script checks the marker key it derives, in the stream's slot

        presence = Presence(presence_client, KEYS, "w1")
        await presence.refresh()
        await node.leases.renew()
        assert await absent_workers(redis, KEYS, me="other") == set()  # w1's connection is seen on its node
        await presence.aclose()
        assert await wait_until(lambda: absent_workers(redis, KEYS, me="other"), 5, "w1 never went missing") == {"w1"}
        other = PartitionLeases(redis, KEYS, "w2", partitions=SETTINGS.partitions, lease_ms=SETTINGS.lease_ms,
                                server_clock=ServerClock(FakeClock()))
        assert await other.forget({"w1"}) == SETTINGS.partitions
    finally:
        await fe.stop()
        await redis.aclose()


@needs_binaries
async def test_a_cluster_client_waits_for_a_connection_rather_than_failing(cluster_url: str) -> None:
    """More concurrent commands than connections wait their turn, as on one server's blocking pool."""
    client = make_redis_client(cluster_url, max_connections=2)
    try:
        cache = RedisCache(client, prefix="topo:w:", ttl_s=60)
        await asyncio.gather(*(cache.set(f"k{i}", b"v") for i in range(40)))
        assert await asyncio.gather(*(cache.get(f"k{i}") for i in range(40))) == [b"v"] * 40
        assert cache.available
    finally:
        await client.aclose()



# Cluster node failure


@needs_binaries
async def test_a_cluster_master_killed_under_traffic_costs_the_components_nothing(processes: Processes) -> None:
    """Three masters with a replica each: SIGKILL the master holding the limiter's slot in the middle of
    traffic. The cache and the limiter degrade without raising while its slots have no master, reach the
    promoted replica by themselves, and limits are shared again."""
    ports = replicated_cluster(processes)
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports[:3])
    client, other = make_redis_client(url), make_redis_client(url)
    cache = RedisCache(client, prefix="c:", ttl_s=60, retry_after_s=0.2)
    lim, lim2 = limiter(client, retry_after_s=0.2), limiter(other, retry_after_s=0.2)
    roomy = [LimitSpec("tier:loop", rpm=1_000_000, tpm=None)]

    async def one_round(i: int) -> bool:
        """A cache write and read on a key of every node, and a limiter call; True when all reached Redis."""
        await cache.set_many({f"k{i}-{n}": b"v" for n in range(6)})
        hit = await cache.get_many([f"k{i}-{n}" for n in range(6)]) == [b"v"] * 6
        await lim.reserve(roomy, 1)  # never refused: a lost slot means the local fallback
        return hit and lim._down_until is None

    try:
        for i in range(10):
            assert await one_round(i)
        slot = int(cli(ports[0], "CLUSTER", "KEYSLOT", "{mb:rl}").strip())
        processes.kill(owner_of(ports, slot))
        rounds = iter(range(10, 100_000))
        await wait_until(lambda: one_round(next(rounds)), FAILOVER_S, "the components never reached the promoted "
                         "replica", interval_s=0.05)
        for i in range(10):  # steady again
            assert await one_round(100_000 + i)
        tight = [LimitSpec("tier:after", rpm=5, tpm=None)]
        assert await admitted(lim, tight, 3) + await admitted(lim2, tight, 3) == 5
    finally:
        await client.aclose()
        await other.aclose()


def started_cluster(processes: Processes, *, replicas: int, node_timeout_ms: int) -> list[int]:
    """Three masters with `replicas` replicas each, every slot assigned and the cluster state ok; their ports."""
    ports = [cluster_port() for _ in range(3 * (1 + replicas))]
    for port in ports:
        processes.start(port, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                        "--cluster-node-timeout", str(node_timeout_ms), *QUICK_SYNC)
    assert CLI is not None
    subprocess.run([CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas",
                    str(replicas), "--cluster-yes"], capture_output=True, check=True, timeout=30)
    wait_until_blocking(lambda: all("cluster_state:ok" in cli(p, "CLUSTER", "INFO") for p in ports), 20,
                        "the cluster never reached cluster_state:ok")
    return ports


def replicated_cluster(processes: Processes) -> list[int]:
    """Three masters with a replica each, every slot assigned and every replica linked; their ports."""
    ports = started_cluster(processes, replicas=1, node_timeout_ms=1000)
    # A replica still syncing cannot take over: its master's death would leave the slots without one. Set-up
    # only, so the wait is generous: six servers' first syncs on a loaded 2-core host took over 20 s once.
    wait_until_blocking(lambda: sum("master_link_status:up" in cli(p, "INFO", "replication") for p in ports) == 3,
                        60, "the replicas never linked to their masters")
    return ports


def owner_of(ports: list[int], slot: int) -> int:
    """The master serving `slot`."""
    for port in ports:
        for served in _slot_ranges(port):
            low, _, high = served.partition("-")
            if int(low) <= slot <= int(high or low):
                return port
    raise AssertionError(f"no master serves slot {slot}")


def _slot_ranges(port: int) -> list[str]:
    """The slot ranges ("0-5460") the node on `port` serves as a master."""
    ranges = []
    for line in cli(port, "CLUSTER", "NODES").splitlines():
        fields = line.split()
        if len(fields) > 8 and "myself" in fields[2] and "master" in fields[2]:
            ranges += [f for f in fields[8:] if f[0].isdigit()]
    return ranges
