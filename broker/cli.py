"""`mergebroker` command line: serve, drain, worker, simulate, report, eval, warm-cache, mcp, bench."""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download model weights at run time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mergebroker",
        description="An OpenAI-compatible LLM request-merge broker: coalesces, caches and merges similar "
                    "requests before they reach your providers.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the broker", description=(
        "Run the broker. Without --config, --upstream or configured providers it serves from the built-in "
        "simulated upstream (synthetic answers) so you can try it with no API key."))
    serve.add_argument("--config", metavar="FILE", help="YAML config file (default: $MERGEBROKER_CONFIG)")
    serve.add_argument("--host", help="listen address (default from config: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default from config: 8080)")
    serve.add_argument("--upstream", action="append", metavar="URL", default=[],
                       help="OpenAI-compatible base URL (e.g. https://api.example.com/v1) serving every model; "
                            "repeat for a pool with failover. API key from $MERGEBROKER_UPSTREAM_API_KEY.")

    drain = sub.add_parser("drain", help="drain a running broker (a preStop hook) and wait until it is idle",
                           description="Ask the broker to drain (POST /v1/broker/drain): it turns unready, refuses "
                                       "new requests and lets those in flight finish. Exits 0 once nothing is in "
                                       "flight, 1 if work was left at the deadline, 2 if the broker cannot be asked.")
    drain.add_argument("--url", help="the broker's base URL (default: http://127.0.0.1:<server.port of the "
                                     "config or $MERGEBROKER_SERVER__PORT, 8080>)")
    drain.add_argument("--timeout", type=float, metavar="S", help="answer after at most S seconds even if work is "
                                                                   "left (default: the broker's drain_timeout_s)")
    drain.add_argument("--config", metavar="FILE", help="YAML config file (default: $MERGEBROKER_CONFIG)")

    from mergebroker.providers.simulator.cli import add_simulate_arguments

    simulate = sub.add_parser("simulate", help="run the simulated OpenAI-compatible upstream",
                              description="Run the simulated upstream used by tests, demos and benchmarks.")
    add_simulate_arguments(simulate)

    from mergebroker.broker.engine.accounting.report import add_report_arguments

    report = sub.add_parser("report", help="summarise the usage ledger",
                            description="Requests, merge rate, cache rates, tokens and calls saved, cost per tenant.")
    add_report_arguments(report)

    from mergebroker.broker.eval.cli import add_eval_arguments

    evaluate = sub.add_parser("eval", help="measure merged answers against alone answers on an upstream",
                              description="Run a request set (or the built-in questions) alone and in merged "
                                          "batches against one upstream model; write a report with a suggested "
                                          "max_batch.")
    add_eval_arguments(evaluate)

    warm = sub.add_parser("warm-cache", help="pre-fill the embedding caches from a file of texts",
                          description="Embed every line of FILE through the broker's own embedding path.")
    warm.add_argument("file", metavar="FILE", help="texts, one per line")
    warm.add_argument("--config", metavar="FILE")
    warm.add_argument("--model", default="all-MiniLM-L6-v2", help="embedding model (default: %(default)s)")
    warm.add_argument("--batch", type=int, default=64, help="texts per request (default: %(default)s)")
    worker = sub.add_parser("worker", help="run a queue worker of cluster mode",
                            description="Read chat jobs from the Redis Streams partitions this worker leases, "
                                        "merge and dispatch them, and answer the front-ends (cluster mode).")
    worker.add_argument("--config", metavar="FILE", help="YAML config file with redis.url (default: $MERGEBROKER_CONFIG)")
    worker.add_argument("--metrics-port", type=int, default=9100, help="port of /metrics, /healthz and /readyz "
                                                                        "(default: %(default)s; 0: any free port)")
    worker.add_argument("--host", help="listen address of that port (default from config: 127.0.0.1)")
    from mergebroker.broker.mcp.cli import add_mcp_arguments

    mcp = sub.add_parser("mcp", help="serve the broker to agents over MCP (stdio or streamable HTTP)",
                         description="An MCP server with the tools chat, embed, count_tokens and broker_stats, "
                                     "running the broker embedded or calling one with --broker URL. "
                                     "Needs the extra: pip install 'mergebroker[mcp]'.")
    add_mcp_arguments(mcp)
    bench = sub.add_parser("bench", help="run the benchmarks and write docs/benchmarks.md",
                           description="Run the standard workloads against the simulated upstream and write "
                                       "docs/benchmarks.md with tables and charts. Options after 'bench' go to "
                                       "the benchmark runner: mergebroker bench --quick, --from-results, ...")
    bench.add_argument("--quick", action="store_true", help="smoke-sized runs")
    bench.add_argument("--from-results", action="store_true", help="render the existing result JSON only")
    return parser


BENCH_FROM_CHECKOUT = ("mergebroker bench runs from a checkout of the repository (bench/ is not installed): "
                       "cd into the checkout and run `.venv/bin/mergebroker bench` (or `python -m bench.report`) there.")


def _bench(argv: list[str]) -> int:
    """Run the checkout's benchmark runner; it has its own parser, which takes every option."""
    if os.path.isfile(os.path.join("bench", "report.py")) and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a console script does not put the working directory on the path
    try:
        # Looked up at run time, not imported: bench/ is not part of the installed package.
        runner = importlib.import_module("bench.report")
    except ModuleNotFoundError:
        print(BENCH_FROM_CHECKOUT, file=sys.stderr)
        return 2
    return runner.main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and "-h" not in argv and "--help" not in argv:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "drain":
        return _drain(args)
    if args.command == "worker":
        from mergebroker.broker.http.worker_app import run_worker

        return run_worker(args)
    if args.command == "simulate":
        from mergebroker.providers.simulator.cli import serve_simulator

        try:
            asyncio.run(serve_simulator(args))
        except KeyboardInterrupt:
            pass
        return 0
    if args.command == "report":
        from mergebroker.broker.engine.accounting.report import run_report

        return run_report(args)
    if args.command == "mcp":
        from mergebroker.broker.mcp.cli import run_mcp

        return run_mcp(args)
    if args.command == "eval":
        from mergebroker.broker.eval.cli import run_eval

        return run_eval(args)
    if args.command == "warm-cache":
        from mergebroker.broker.warm_cache import run_warm_cache

        return run_warm_cache(args)
    return 2


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings that `serve`'s flags set; they win over the environment and the config file."""
    overrides: dict[str, Any] = {}
    server = {name: value for name, value in (("host", args.host), ("port", args.port)) if value is not None}
    if server:
        overrides["server"] = server
    if args.upstream:
        overrides["providers"] = [
            {"name": f"upstream-{i}", "base_url": url, "api_key_env": "MERGEBROKER_UPSTREAM_API_KEY"}
            for i, url in enumerate(args.upstream)]
    return overrides


def _serve(args: argparse.Namespace) -> int:
    import structlog

    from mergebroker.broker.engine.ground.config import load_settings, settings_for_command
    from mergebroker.broker.engine.ground.logging import configure_logging
    from mergebroker.broker.http.app import create_app
    from mergebroker.broker.http.server import http_parser_kind, serve
    from mergebroker.eventloop import loop_kind, new_event_loop

    settings = settings_for_command(args.config, overrides=serve_overrides(args))
    if settings is None:
        return 2
    configure_logging(settings.logging.level, json_lines=settings.logging.json_lines,
                      request_lines_per_s=settings.logging.request_lines_per_s)
    loop_factory = functools.partial(new_event_loop, settings.server.event_loop)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        structlog.get_logger(__name__).info("event_loop", kind=loop_kind(runner.get_loop()),
                                            http_parser=http_parser_kind())
        reload_from = functools.partial(load_settings, args.config, overrides=serve_overrides(args))
        runner.run(serve(create_app(settings, reload_from=reload_from), settings.server))
    return 0


def _drain(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    from mergebroker.broker.engine.ground.config import settings_for_command

    settings = settings_for_command(args.config)
    if settings is None:
        return 2
    server = settings.server
    base = (args.url or f"http://{_loopback_for(server.host)}:{server.port}").rstrip("/")
    query = f"?{urllib.parse.urlencode({'timeout_s': args.timeout})}" if args.timeout is not None else ""
    headers = {}
    if server.metrics_token is not None:  # lets the call through from a peer that is not loopback
        headers["Authorization"] = f"Bearer {server.metrics_token.get_secret_value()}"
    request = urllib.request.Request(f"{base}/v1/broker/drain{query}", data=b"", method="POST", headers=headers)
    wait_s = args.timeout if args.timeout is not None else server.drain_timeout_s
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via $HTTP_PROXY
        with opener.open(request, timeout=wait_s + 30) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(f"mergebroker: {base} refused the drain ({exc.code}): {exc.read()[:500].decode(errors='replace')}",
              file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"mergebroker: cannot drain {base}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(answer))
    return 0 if answer.get("drained") else 1


def _loopback_for(host: str) -> str:
    """Where to reach a broker listening on `host` from inside its own pod or machine."""
    if host in ("", "0.0.0.0", "127.0.0.1", "localhost"):
        return "127.0.0.1"
    if host in ("::", "::1"):
        return "[::1]"
    return f"[{host}]" if ":" in host else host


if __name__ == "__main__":
    sys.exit(main())
