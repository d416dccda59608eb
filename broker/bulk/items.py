"""A job's lines as the planner sees them (pure): fingerprint, merge shape and key (by the live path's rule,
`merge.mergeable`), token counts.

Token counting is the cost, so the runner calls `bulk_items` in a worker thread. A line for a model no
provider serves gets its 404 here; a line that cannot be described (a body that trips the fingerprint or the
token counter) gets its own 400 and the rest of the job goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from mergebroker.broker.bulk.lines import BatchLine
from mergebroker.broker.bulk.settling import Result
from mergebroker.broker.engine.chat.units import unit_rules
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.broker.engine.ground.tokens import count_text_tokens, estimate_prompt_tokens
from mergebroker.errors import InvalidRequest, NotFound
from mergebroker.merge.compaction import BulkItem
from mergebroker.merge.mergeable import UnitRules

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
    rules = unit_rules(ctx.settings, ctx.settings.tier(ctx.tier))
    for line in lines:
        model = line.body["model"]
        if model not in ctx.served:
            refused.append((line.custom_id, 404, NotFound(
                f"The model '{model}' does not exist or you do not have access to it.", param="model",
                code="model_not_found").body()))
            continue
        try:
            items.append(_item(line, ctx, rules))
        except (ValueError, TypeError, RecursionError, UnicodeError) as exc:
            log.warning("bulk_line_unplannable", custom_id_chars=len(line.custom_id), error=type(exc).__name__)
            refused.append((line.custom_id, 400, InvalidRequest(
                "This request could not be read for sending.", code="invalid_request").body()))
    return items, refused


def _item(line: BatchLine, ctx: ItemContext, rules: UnitRules) -> BulkItem:
    # The live path's rule; a line's end user (`merge.scope: user`) is the one its body names.
    unit = rules.unit(
        line.body, tenant=ctx.tenant, tier=ctx.tier, user=line.body.get("user"),
        mergeable=line.mergeable and line.body["model"] in ctx.mergeable)
    shape = unit.shape
    return BulkItem(line.custom_id, unit.body, unit.fingerprint, shape, unit.merge_key,
                    estimate_prompt_tokens(unit.body["messages"]), count_text_tokens(shape.user_text) if shape else 0,
                    unit.max_tokens)
