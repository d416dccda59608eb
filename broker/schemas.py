"""Request bodies at the HTTP edge: pydantic validation, OpenAI-style 400s, broker-only fields stripped.

Validation only decides whether a body is acceptable; the body that travels on is the caller's own dict,
so unknown fields reach the upstream untouched. The optional `broker` object (`{"tier", "timeout_s",
"merge"}`) is ours and never forwarded.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mergebroker.errors import InvalidRequest

BROKER_FIELD = "broker"


class BrokerOptions(BaseModel):
    """Per-request broker options; everything optional."""

    model_config = ConfigDict(extra="forbid")
    tier: str | None = None
    timeout_s: float | None = Field(None, gt=0)
    merge: bool | None = None


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[_TextPart] | None = None

    @field_validator("content")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise ValueError("content must not be empty")
        if isinstance(value, list) and not value:
            raise ValueError("content must not be an empty list")
        return value


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    user: str | None = None
    broker: BrokerOptions | None = None

    @field_validator("messages")
    @classmethod
    def _user_content(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        for i, message in enumerate(messages):
            if message.role in ("user", "system", "developer") and message.content is None:
                raise ValueError(f"messages[{i}].content is required for role {message.role!r}")
        return messages

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("stop may hold at most 4 sequences")
        return value


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    broker: BrokerOptions | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, str) and not value:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and (not value or any(isinstance(v, str) and not v for v in value)):
            raise ValueError("input must be a non-empty string or a non-empty list of non-empty strings")
        if isinstance(value, list) and len(value) > 2048:
            raise ValueError("input may hold at most 2048 items")
        return value


def parse_chat(body: Any, *, max_messages: int | None = None) -> tuple[ChatRequest, dict[str, Any]]:
    """Validate a chat body; return the model and the dict to forward (broker-only fields removed).

    `max_messages` is checked before anything else, so a body of a hundred thousand messages costs no
    validation.
    """
    messages = body.get("messages") if isinstance(body, dict) else None
    if max_messages is not None and isinstance(messages, list) and len(messages) > max_messages:
        raise InvalidRequest(f"Invalid value for 'messages': at most {max_messages} messages are accepted.",
                             param="messages", code="invalid_value")
    return _parse(ChatRequest, body)


def parse_embeddings(body: Any) -> tuple[EmbeddingRequest, dict[str, Any]]:
    """Validate an embeddings body; return the model and the dict to forward."""
    return _parse(EmbeddingRequest, body)


def _parse(model: type[BaseModel], body: Any) -> tuple[Any, dict[str, Any]]:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_body")
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        raise _as_invalid(exc) from None
    forward = {k: v for k, v in body.items() if k != BROKER_FIELD}
    return parsed, forward


def _as_invalid(exc: ValidationError) -> InvalidRequest:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if not str(p).startswith(("str", "list[", "int", "float"))]
    param = ".".join(loc) or None
    kind = err["type"]
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
    elif kind == "literal_error" and loc and loc[-1] == "role":
        message = f"Invalid value for '{param}': {err['msg']}."
    else:
        message = f"Invalid value for '{param}': {err['msg']}." if param else err["msg"]
    return InvalidRequest(message, param=param, code="missing_required_parameter" if kind == "missing" else
                          "invalid_value")
