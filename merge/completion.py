"""A merged member's own `chat.completion`, cut out of a merged reply (pure)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from mergebroker.token_usage import TokenUsage


def member_completion(reply: dict[str, Any], text: str, usage: TokenUsage, *, model: str = "",
                      finish_reason: str = "stop") -> dict[str, Any]:
    """A complete `chat.completion` of a member's own, cut out of a merged reply: every field an unmerged
    answer has (the spec's required `refusal` too); `model` stands in when the reply names none;
    `finish_reason` is "length" for an answer cut at the member's own budget."""
    body = {
        "id": "chatcmpl-" + uuid.uuid4().hex[:24],
        "object": "chat.completion",
        "created": reply.get("created") if isinstance(reply.get("created"), int) else int(time.time()),
        "model": reply.get("model") if isinstance(reply.get("model"), str) else model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage.as_body(),
    }
    if isinstance(reply.get("system_fingerprint"), str):
        body["system_fingerprint"] = reply["system_fingerprint"]
    return body
