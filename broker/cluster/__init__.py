"""Cluster mode: chat jobs travel from front-ends to queue workers on Redis Streams.

    wire.py       the job and reply formats (pure)
    partition.py  merge key -> partition -> stream; the fair share of partitions (pure)
    server_time.py one clock for the cluster: Redis server time, offset against the local monotonic clock
    leases.py     partition leases (set-if-absent with expiry, renewed; a lost lease stops the reading)
    frontend.py   `ClusterQueue`: XADD a job, await its reply; falls back to in-process merging without Redis
    consumer.py   the worker's side: XREADGROUP by tier priority, heartbeats, XAUTOCLAIM, replies
"""
