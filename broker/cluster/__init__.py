"""Cluster mode: chat jobs travel from front-ends to queue workers on Redis Streams.

    wire.py        the job and reply formats (pure)
    partition.py   merge key -> partition -> stream; the fair share of partitions; every key's name (pure)
    server_time.py one clock for the cluster: Redis server time, offset against the local monotonic clock
    client.py      the Redis client of the streams
    outage.py      one warning per Redis outage, and what a process does when it starts
    frontend.py    `ClusterQueue`: XADD a job, await its reply; falls back to in-process merging without Redis
    inflight.py    the jobs a front-end awaits, and which of them a worker sent upstream
    leases.py      partition leases (set-if-absent with expiry, renewed; a lost lease stops the reading)
    presence.py    a dead worker told from a paused one by the connection it keeps open
    holds.py       what a worker holds: heartbeats, and the fence that keeps a job from running twice
    claims.py      which of another worker's jobs may be taken over, decided purely, done atomically
    markers.py     sent markers written before the upstream call, only on entries still the worker's
    outbox.py      a worker's writes (markers, notes, replies, acknowledgements) in one pipeline
    consumer.py    the worker's side: XREADGROUP by tier priority, backlogs in one piece, answers
    worker.py      the worker's loops; worker_runtime.py: a worker process's parts
"""
