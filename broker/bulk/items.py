"""A job's lines as the planner sees them (pure): fingerprint, merge shape and key, token counts.

Token counting is the cost, so the runner calls `bulk_items` in a worker thread. A line for a model no
provider serves gets its 404 here; a line that cannot be described (a body that trips the fingerprint or the
token counter) gets its own 400 and the rest of the job goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import structlog

from mergebroker.broker.bulk.lines import BatchLine
from mergebroker.broker.bulk.settling import Result
from mergebroker.broker.engine.settings import Settings
from mergebroker.broker.engine.tokens import count_text_tokens, estimate_prompt_tokens
from mergebroker.errors import InvalidRequest, NotFound
from mergebroker.output_budget import token_budget
from mergebroker.merge.compaction import BulkItem
from mergebroker.merge.fingerprint import chat_fingerprint
from mergebroker.merge.shape import compatibility_key, merge_shape

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ItemContext:
    """What describing a line depends on: the settings, the job's tier and tenant, the models served."""

    settings: Settings
    tier: str
    tenant: str
    served: frozenset[str]
    mergeable: frozenset[str]


def bulk_items(lines: Sequence[BatchLine], ctx: ItemContext) -> tuple[list[BulkItem], list[Result]]:
    """The lines to plan, and the results of those refused outright."""
    items: list[BulkItem] = []
    refused: list[Result] = []
    for line in lines:
        model = line.body["model"]
        if model not in ctx.served:
            refused.append((line.custom_id, 404, NotFound(
                f"The model '{model}' does not exist or you do not have access to it.", param="model",
                code="model_not_found").body()))
            continue
        try:
            items.append(_item(line, ctx))
        except (ValueError, TypeError, RecursionError, UnicodeError) as exc:
            log.warning("bulk_line_unplannable", custom_id_chars=len(line.custom_id), error=type(exc).__name__)
            refused.append((line.custom_id, 400, InvalidRequest(
                "This request could not be read for sending.", code="invalid_request").body()))
    return items, refused


def _item(line: BatchLine, ctx: ItemContext) -> BulkItem:
    settings = ctx.settings
    tier = settings.tier(ctx.tier)
    merging = settings.merge.enabled and tier.merge
    body = line.body
    if tier.omitted_temperature_is_zero and body.get("temperature") is None:
        body = {**body, "temperature": 0}
    shape = merge_shape(body) if merging and line.mergeable and body["model"] in ctx.mergeable else None
    scope = _scope(settings, ctx.tenant, body)
    key = (compatibility_key(body, shape, scope_value=scope, include_system=tier.system_prompts == "exact")
           if shape else None)
    fingerprint = scope + ":" + chat_fingerprint(
        body, lowercase=settings.merge.lowercase, collapse_whitespace=settings.merge.collapse_whitespace,
        cache_version=settings.merge.cache_version)
    max_tokens = token_budget(body, settings.merge.default_max_tokens)
    return BulkItem(line.custom_id, body, fingerprint, shape, key, estimate_prompt_tokens(body["messages"]),
                    count_text_tokens(shape.user_text) if shape else 0, max_tokens)


def _scope(settings: Settings, tenant: str, body: dict[str, Any]) -> str:
    # Lines of one file share a tenant; with `merge.scope: user` their end users must not share a call.
    if settings.merge.scope == "user":
        return "user:" + json.dumps([tenant, body.get("user") or ""])
    return "tenant:" + json.dumps(tenant)
