"""Logs are structured events with stable keys, and never carry prompts or keys."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime

from structlog.testing import capture_logs

from mergebroker.broker.engine.ground.logging import RequestLogSampler, redact_secrets
from mergebroker.clock import FakeClock
from tests.conftest import provider_for

API_KEY = "sk-test-never-logged-123456"
PROMPT = "my private question about project nightingale"


async def test_one_request_event_with_stable_keys_and_no_prompt_or_key(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator, api_key_env="SIM_KEY")],
                                 "merge": {"enabled": False}}, environ={"SIM_KEY": API_KEY})
    with capture_logs() as events:
        status, _, _ = await broker.chat(PROMPT, headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200
    requests = [e for e in events if e["event"] == "request"]
    assert len(requests) == 1
    assert {"endpoint", "status", "tenant", "tier", "model", "latency_ms", "upstream_ms", "batch_size",
            "cache"} <= set(requests[0])
    dumped = json.dumps(events, default=str)
    assert API_KEY not in dumped and "nightingale" not in dumped


def test_redaction_processor_drops_secret_and_prompt_fields():
    event = {"event": "x", "api_key": API_KEY, "Authorization": "Bearer k", "messages": [PROMPT],
             "prompt_tokens": 12}
    cleaned = redact_secrets(None, "info", dict(event))
    assert cleaned["api_key"] == cleaned["Authorization"] == cleaned["messages"] == "[redacted]"
    assert cleaned["prompt_tokens"] == 12


def test_redaction_holds_for_keys_already_seen():
    """Keys found harmless are remembered; a secret-looking key is redacted every time it comes, and a
    harmless key seen first never hides a secret one that arrives with it later."""
    first = redact_secrets(None, "info", {"event": "x", "tenant": "t", "password": "p1"})
    second = redact_secrets(None, "info", {"event": "x", "tenant": "t", "password": "p2", "API_KEY": "k"})
    assert first["password"] == second["password"] == second["API_KEY"] == "[redacted]"
    assert second["tenant"] == "t"


def test_provider_settings_never_show_the_key():
    from mergebroker.broker.engine.ground.config import load_settings

    settings = load_settings(None, environ={"K": API_KEY},
                             overrides={"providers": [{"name": "p", "base_url": "http://x/v1", "api_key_env": "K"}]})
    assert settings.providers[0].api_key.get_secret_value() == API_KEY
    assert API_KEY not in repr(settings) and API_KEY not in settings.model_dump_json()


def test_json_lines_are_one_parseable_object_per_event_with_a_utc_timestamp():
    """What `configure_logging` writes in a serving process: orjson-rendered lines, each with level and an
    ISO-8601 UTC timestamp to the microsecond, secrets redacted (run in a child: configuring is process-wide)."""
    code = ("from mergebroker.broker.engine.ground.logging import configure_logging; import structlog;"
            "configure_logging('info'); log = structlog.get_logger('t');"
            "[log.info('request', n=i, api_key='sk-x', ratio=0.5) for i in range(3)]; log.debug('hidden')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=True)
    lines = [json.loads(line) for line in done.stderr.decode().splitlines()]
    assert [line["n"] for line in lines] == [0, 1, 2]
    assert all(line["level"] == "info" and line["api_key"] == "[redacted]" and line["ratio"] == 0.5 for line in lines)
    stamps = [datetime.strptime(line["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ") for line in lines]
    assert stamps == sorted(stamps)


def test_request_lines_are_sampled_past_the_rate_errors_always_written_and_the_skipped_counted():
    """At 3 lines a second, a burst of 10 successes writes 3; an error still writes; a second later one
    `request_log_sampled` line says how many were skipped, and the bucket has refilled."""
    clock = FakeClock()
    sampler = RequestLogSampler(3, clock=clock)
    with capture_logs() as logged:
        burst = [sampler.admit(error=False) for _ in range(10)]
        assert burst == [True] * 3 + [False] * 7
        assert sampler.admit(error=True)
        clock.advance(1.0)
        assert [sampler.admit(error=False) for _ in range(4)] == [True, True, True, False]
    assert [(e["event"], e.get("skipped")) for e in logged] == [("request_log_sampled", 7)]


def test_without_a_rate_every_request_is_written():
    sampler = RequestLogSampler(None, clock=FakeClock())
    assert all(sampler.admit(error=False) for _ in range(1000))


def test_bound_keys_reach_every_event_of_the_task_and_its_children_but_never_override_an_events_own():
    """`bind_log_context` (what the middleware binds a request's IDs with): a child task starts with its
    creator's keys and binds its own without touching the creator's; an event's own key wins; an unbound
    key is gone from later events (run in a child: configuring is process-wide)."""
    code = ("import asyncio, structlog\n"
            "from mergebroker.broker.engine.ground.logging import configure_logging, bind_log_context, "
            "unbind_log_context\n"
            "configure_logging('info'); log = structlog.get_logger('t')\n"
            "async def child():\n"
            "    bind_log_context(request_id='r2'); log.info('child')\n"
            "async def main():\n"
            "    bind_log_context(request_id='r1', batch_id='b1')\n"
            "    await asyncio.create_task(child())\n"
            "    log.info('own', request_id='mine')\n"
            "    unbind_log_context('batch_id'); log.info('after')\n"
            "asyncio.run(main())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=True)
    lines = {line["event"]: line for line in map(json.loads, done.stderr.decode().splitlines())}
    assert (lines["child"]["request_id"], lines["child"]["batch_id"]) == ("r2", "b1")
    assert (lines["own"]["request_id"], lines["own"]["batch_id"]) == ("mine", "b1")
    assert lines["after"]["request_id"] == "r1" and "batch_id" not in lines["after"]


def test_the_request_lines_direct_rendering_writes_what_structlog_would_and_follows_the_level():
    """`log_info_event` (the request line's writer) renders the line itself: the same keys in the same order as
    the structlog pipeline's line (bound keys, level, timestamp, secrets redacted), nothing below the level, and
    under a pipeline it did not set up (here a test's `capture_logs`) the event goes through structlog."""
    code = ("import structlog, sys\n"
            "from structlog.testing import capture_logs\n"
            "from mergebroker.broker.engine.ground.logging import configure_logging, bind_log_context, log_info_event\n"
            "log = structlog.get_logger('t')\n"
            "configure_logging(sys.argv[1]); bind_log_context(request_id='r1')\n"
            "fields = lambda: {'status': 200, 'batch_id': None, 'api_key': 'sk-x', 'latency_ms': 1.5}\n"
            "log.info('request', **fields()); log_info_event(log, 'request', fields())\n"
            "with capture_logs() as events:\n"
            "    log_info_event(structlog.get_logger('u'), 'request', fields())\n"
            "print(len(events))\n")
    done = subprocess.run([sys.executable, "-c", code, "info"], capture_output=True, timeout=60, check=True)
    through_structlog, direct = [json.loads(line) for line in done.stderr.decode().splitlines()]
    assert list(direct) == list(through_structlog) == ["status", "batch_id", "api_key", "latency_ms", "event",
                                                       "request_id", "level", "timestamp"]
    assert {**direct, "timestamp": None} == {**through_structlog, "timestamp": None}
    assert direct["api_key"] == "[redacted]" and direct["request_id"] == "r1"
    assert done.stdout.decode().strip() == "1"
    quiet = subprocess.run([sys.executable, "-c", code, "warning"], capture_output=True, timeout=60, check=True)
    assert quiet.stderr == b""
