"""Every benchmark, by name: the one list `python -m bench` runs from and `bench.report` renders from.

A `Benchmark` names its module (which has `main(argv) -> int`), what it measures, and whether
`python -m bench report` runs it for docs/benchmarks.md (`report`: the name of its part there). The modules
are imported only when one is run, so listing them costs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """One runnable benchmark (or helper process) of `bench/`."""

    name: str
    measures: str
    report: str | None = None  # its part of docs/benchmarks.md, when the report runs it
    process: bool = False  # a process other benchmarks start (an upstream, a proxy), not a benchmark itself

    @property
    def module(self) -> str:
        return f"bench.{self.name}"

    def entry(self) -> Callable[[Sequence[str] | None], int]:
        """Its `main(argv)`."""
        main: Callable[[Sequence[str] | None], int] = importlib.import_module(self.module).main
        return main


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("passthrough", "overhead against the simulator direct and a minimal proxy, merging and cache off",
              report="passthrough"),
    Benchmark("tiers", "realtime and batch tiers competing for a provider with a fixed RPM", report="tiers"),
    Benchmark("chaos", "steady traffic while the upstream goes healthy, 50% errors, down, healthy", report="chaos"),
    Benchmark("merging", "passthrough against merging on a simulator with realistic latency", report="merging"),
    Benchmark("embeddings", "the local embedding model behind /v1/embeddings", report="embeddings"),
    Benchmark("provider_kinds", "passthrough over OpenAI, Anthropic and Azure upstreams side by side",
              report="provider_kinds"),
    Benchmark("bulk", "a batch file compacted by the broker against its lines sent one by one", report="bulk"),
    Benchmark("latency", "adaptive windows and early release beside the old behaviour", report="latency"),
    Benchmark("cluster", "one replica, N replicas and cluster mode on the same batch-tier workload",
              report="cluster"),
    Benchmark("cost", "the bill of a caching provider, direct and through the broker, on other tokenizers"),
    Benchmark("bursts", "hot-question bursts on the standard tier, on a quiet host and a busy one"),
    Benchmark("cluster_savings", "whether cluster mode keeps one replica's call savings"),
    Benchmark("embedding_backends", "the similarity model's backends: CPU per text and cosine drift"),
    Benchmark("drain", "SIGTERM while 100 minute-long streams are open: how many finish whole, what new requests get"),
    Benchmark("hostile", "fuzzed requests, slowloris, a noisy tenant and exfiltration attempts"),
    Benchmark("hostile_bulk", "hostile bulk clients against the Batch API"),
    Benchmark("inbound_apis", "what the Responses and Messages APIs cost per request against chat"),
    Benchmark("non_streaming", "merged calls to upstreams that do not stream, beside one that does"),
    Benchmark("profile_broker", "where the request path's CPU goes (cProfile or a sampler)"),
    Benchmark("components", "the passthrough request's CPU by component at concurrency 1 and 64, beside the proxy's"),
    Benchmark("engine_glue", "the broker's own work per chat request, in-process over an instant upstream (no HTTP)"),
    Benchmark("instructions", "instructions per request of the broker and the minimal proxy under callgrind (exact, "
              "unmoved by a busy host)"),
    Benchmark("bytecodes", "Python bytecodes per request of the broker and the proxy, the broker's by module and "
              "function (exact, about a minute)"),
    Benchmark("streams", "streamed chat in passthrough: CPU per stream and time to the first event, old and new"),
    Benchmark("conversations", "agent conversations re-sent whole every turn, at the defaults with a priced model: "
              "CPU per turn, old and new"),
    Benchmark("simulator_billing", "what OpenAI-style billing and its prompt cache do to the simulator's bill"),
    Benchmark("proxy_baseline", "a minimal aiohttp reverse proxy, the floor passthrough is measured against",
              process=True),
)
BY_NAME = {b.name: b for b in BENCHMARKS}
