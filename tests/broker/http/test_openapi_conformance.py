"""Schemathesis against a real broker on loopback, on the official OpenAI spec's chat, embeddings, models, files
and batches operations: no server error, no hung request, every documented answer matches its schema and every
error leaves in the spec's `ErrorResponse` envelope, apart from the spec's own gaps listed in `KNOWN_GAPS`."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance
from schemathesis.transport.serialization import Binary

from tests.helpers.paths import DATA

SPEC_PATH = DATA / "openai_spec_subset.yaml"
MAX_EXAMPLES = 50
"""Per operation and generation mode: 13 operations x 2 modes x 50: about two minutes on two cores."""
REQUEST_TIMEOUT_S = 15.0
"""Every answer here is quick (simulated upstream); one that takes longer is a hung request, i.e. a bug."""


@dataclass(frozen=True)
class Gap:
    """A schema violation the spec itself causes: in `operations`' answers, any of `fields` may hold a `kind`
    value ("null" or "string") that the spec's schema does not allow."""

    operations: tuple[str, ...]
    fields: tuple[str, ...]
    kind: str
    reason: str

    def covers(self, operation: str, failure: Failure) -> bool:
        path = getattr(failure, "instance_path", None)
        if operation not in self.operations or not path or path[-1] not in self.fields:
            return False
        value = failure.instance
        return value is None if self.kind == "null" else isinstance(value, str)


BATCH_OPS = ("POST /batches", "GET /batches", "GET /batches/{batch_id}", "POST /batches/{batch_id}/cancel")
FILE_OPS = ("POST /files", "GET /files", "GET /files/{file_id}")

KNOWN_GAPS = (
    Gap(("POST /embeddings",), ("embedding",), "string",
        "with encoding_format=base64 each embedding is a base64 string, as the live API sends; the spec's "
        "Embedding only describes the float list"),
    Gap(("GET /files", "GET /batches"), ("first_id", "last_id"), "null",
        "an empty page has first_id/last_id null, as the live API sends; the spec types them as strings"),
    Gap(BATCH_OPS, ("errors", "output_file_id", "error_file_id", "in_progress_at", "finalizing_at",
                    "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at"), "null",
        "a Batch's unset fields are null, as the live API sends and as the spec's own Batch examples show; "
        "its schema types them without null"),
    Gap(FILE_OPS, ("status_details",), "null",
        "the deprecated OpenAIFile.status_details is null when there is nothing to say, as the live API "
        "sends (the official SDKs type it optional); the spec types it as a string"),
)


def load_spec() -> dict[str, Any]:
    """The extract, with the stream's schema stated so that the spec's meaning survives OpenAPI 3.2's reading.

    The spec gives the chunk schema as the `text/event-stream` schema, meaning each event's `data`; schemathesis
    (after OpenAPI 3.2) validates the parsed event object itself against it. `itemSchema` says what is meant:
    each event's data is a chunk, or the closing `[DONE]`."""
    spec = yaml.safe_load(SPEC_PATH.read_text())
    stream = spec["paths"]["/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    chunk = stream.pop("schema")
    stream["itemSchema"] = {"type": "object", "required": ["data"], "properties": {"data": {
        "if": {"const": "[DONE]"}, "else": {"contentMediaType": "application/json", "contentSchema": chunk}}}}
    return spec


class LoopbackBroker:
    """A broker on 127.0.0.1 with no provider configured (so on its built-in simulated upstream), served from
    its own thread and event loop so that the synchronous schemathesis client can call it."""

    def __init__(self, batches_dir: Path) -> None:
        self._config = {"merge": {"embedder": "none"}, "batches": {"dir": str(batches_dir), "poll_interval_s": 0.05}}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="broker", daemon=True)
        self._runner: Any = None
        self.url = ""

    def start(self) -> None:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=60)
        self.url = f"http://127.0.0.1:{port}/v1"

    async def _serve(self) -> int:
        from aiohttp import web

        from mergebroker.broker.engine.ground.config import load_settings
        from mergebroker.broker.http.app import create_app

        app = create_app(load_settings(None, environ={}, overrides=self._config))
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def batch_file(lines: int) -> bytes:
    """A Batch API input file of `lines` chat requests."""
    body = {"model": "sim-small", "max_tokens": 20, "messages": [{"role": "user", "content": "Hi?"}]}
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": body}) + "\n" for i in range(lines)).encode()


@dataclass(frozen=True)
class Seeded:
    """Objects on the broker, so that generated cases reach past the 404s."""

    file_id: str
    doomed_file_id: str  # for DELETE, so the others stay
    batch_id: str
    new_batch: Callable[[], str]  # a batch still in progress, for a cancel to find


def seed(session: requests.Session, url: str) -> Seeded:
    def upload(lines: int = 1) -> str:
        reply = session.post(f"{url}/files", data={"purpose": "batch"},
                             files={"file": ("in.jsonl", batch_file(lines))}, timeout=REQUEST_TIMEOUT_S)
        assert reply.status_code == 200, reply.text
        return reply.json()["id"]

    def create(file_id: str) -> str:
        reply = session.post(f"{url}/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                     "completion_window": "24h"}, timeout=REQUEST_TIMEOUT_S)
        assert reply.status_code == 200, reply.text
        return reply.json()["id"]

    file_id, long_file_id = upload(), upload(200)  # 200 lines: still running when the cancel comes
    return Seeded(file_id, upload(), create(file_id), lambda: create(long_file_id))


MODELS = {"/chat/completions": "sim-small", "/embeddings": "sim-embed"}
"""The simulated upstream's models (the simplest generated model name is an empty string, refused)."""


def with_real_data(case: Any, use: bool, seeded: Seeded) -> Any:
    """`case` pointed at existing objects and a valid upload when `use` (else as generated)."""
    if not use:
        return case
    params = case.path_parameters or {}
    if "file_id" in params:
        params["file_id"] = seeded.doomed_file_id if case.method.upper() == "DELETE" else seeded.file_id
    if "batch_id" in params:
        params["batch_id"] = seeded.new_batch() if case.path.endswith("/cancel") else seeded.batch_id
    if "model" in params:
        params["model"] = "sim-small"
    if isinstance(case.body, dict) and case.operation.path in MODELS:
        case.body["model"] = MODELS[case.operation.path]
    if isinstance(case.body, dict) and case.operation.path == "/files" and "file" in case.body:
        case.body["file"] = Binary(batch_file(1))
    if isinstance(case.body, dict) and case.operation.path == "/batches":
        case.body["input_file_id"] = seeded.file_id
    return case


@dataclass(frozen=True)
class Finding:
    """One problem: what was sent (as curl), what came back, and why it is wrong."""

    operation: str
    problem: str
    curl: str

    def __str__(self) -> str:
        return f"{self.operation}: {self.problem}\n    {self.curl}"


def _is_known_gap(operation: str, failure: Failure) -> bool:
    return any(gap.covers(operation, failure) for gap in KNOWN_GAPS)


def error_envelope_check(spec: dict[str, Any]) -> Callable[[Any, Any, Any], None]:
    """A schemathesis check: every error answer (4xx, 5xx) carries the spec's `ErrorResponse` envelope."""
    validator = jsonschema.Draft202012Validator({**spec, "$ref": "#/components/schemas/ErrorResponse"})

    def error_envelope(ctx: Any, response: Any, case: Any) -> None:
        if response.status_code < 400 or case.method.upper() == "HEAD":
            return
        try:
            body = json.loads(response.content)
        except ValueError as exc:
            raise Failure(operation=case.operation.label, title="Error answer is not JSON",
                          message=f"{response.status_code}: {exc}") from None
        problems = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(body)]
        if problems:
            raise Failure(operation=case.operation.label, title="Error answer outside the envelope",
                          message=f"{response.status_code}: " + "; ".join(problems[:3]))

    return error_envelope


def probe(operation: Any, mode: GenerationMode, *, base_url: str, seeded: Seeded, checks: list,
          max_examples: int) -> tuple[Counter[int], list[Finding]]:
    """Send `max_examples` generated cases of `operation`; (answers by status, findings), known gaps left out.

    Failures are collected, never raised, so Hypothesis does not shrink: each finding is one real request."""
    findings: list[Finding] = []
    statuses: Counter[int] = Counter()
    session = requests.Session()

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=st.tuples(operation.as_strategy(mode), st.booleans()).map(
        lambda pair: with_real_data(pair[0], pair[1], seeded)))
    def send(case: Any) -> None:
        try:
            response = case.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT_S)
        except requests.Timeout:
            findings.append(Finding(operation.label, "no answer in time (hung request)", case.as_curl_command()))
            return
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=checks)
        except FailureGroup as group:
            failures = list(group.exceptions)
        except Failure as failure:
            failures = [failure]
        else:
            return
        curl = case.as_curl_command()
        findings.extend(Finding(operation.label, f"{f.title}: {f.message}", curl)
                        for f in failures if not _is_known_gap(operation.label, f))

    with session:
        send()
    return statuses, findings


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Any:
    running = LoopbackBroker(tmp_path_factory.mktemp("batches"))
    running.start()
    try:
        with requests.Session() as session:
            yield running, seed(session, running.url)
    finally:
        running.stop()


TIMING_DEPENDENT = ("POST /batches/{batch_id}/cancel",)
"""Answered 200 only while the batch still runs: whether a cancel finds it so depends on timing."""

SPEC = load_spec()
SCHEMA = schemathesis.openapi.from_dict(SPEC)
OPERATIONS = {result.ok().label: result.ok() for result in SCHEMA.get_all_operations()}


def test_the_extract_holds_the_operations_the_broker_serves():
    """Every operation of the issue is in the extract, so none is left out of the run below unnoticed."""
    assert sorted(OPERATIONS) == sorted([
        "POST /chat/completions", "POST /embeddings", "GET /models", "GET /models/{model}", "POST /files",
        "GET /files", "GET /files/{file_id}", "DELETE /files/{file_id}", "GET /files/{file_id}/content",
        "POST /batches", "GET /batches", "GET /batches/{batch_id}", "POST /batches/{batch_id}/cancel"])


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_server_error_and_answers_match_the_official_schema(broker, label, mode):
    """Generated requests, valid and invalid, never get a 5xx or hang, and their answers match the spec."""
    running, seeded = broker
    checks = [not_a_server_error, response_schema_conformance, error_envelope_check(SPEC)]
    statuses, findings = probe(OPERATIONS[label], mode, base_url=running.url, seeded=seeded, checks=checks,
                               max_examples=MAX_EXAMPLES)
    assert not findings, "\n".join(str(f) for f in findings[:10])
    if mode is GenerationMode.POSITIVE and label not in TIMING_DEPENDENT:
        assert any(200 <= s < 300 for s in statuses), f"no valid request got through: {dict(statuses)}"


def test_the_checks_catch_a_bad_chunk_and_a_bad_error_envelope(broker):
    """The stream's chunks and the error envelope are really validated: a tampered answer of each is caught."""
    running, _ = broker
    checks = [response_schema_conformance, error_envelope_check(SPEC)]

    def chat() -> Any:
        return OPERATIONS["POST /chat/completions"].Case(
            body={"model": "sim-small", "stream": True, "messages": [{"role": "user", "content": "Hi?"}]},
            media_type="application/json")

    def missing() -> Any:
        return OPERATIONS["GET /models/{model}"].Case(path_parameters={"model": "no-such-model"})

    with requests.Session() as session:
        def ask(case: Any) -> Any:
            return case.call(base_url=running.url, session=session, timeout=REQUEST_TIMEOUT_S)

        streamed, refused = ask(chat()), ask(missing())
        chat().validate_response(streamed, checks=checks)
        missing().validate_response(refused, checks=checks)
        # New answers to tamper with: a response keeps what it once parsed.
        streamed, refused = ask(chat()), ask(missing())
    assert (streamed.status_code, refused.status_code) == (200, 404)
    streamed.content = b'data: {"id": "x", "object": "chat.completion.chunk"}\n\ndata: [DONE]\n\n'
    with pytest.raises(FailureGroup, match="SSE event violates schema"):
        chat().validate_response(streamed, checks=checks)
    refused.content = b'{"detail": "Not found"}'
    with pytest.raises(FailureGroup, match="outside the envelope"):
        missing().validate_response(refused, checks=checks)
