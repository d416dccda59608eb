"""Request bodies at the HTTP edge: pydantic validation, OpenAI-style 400s, broker-only fields stripped.

Validation only decides whether a body is acceptable; the body that travels on is the caller's own dict,
so unknown fields reach the upstream untouched. Known fields are validated strictly (no coercion: `"stream":
"false"` or a text part whose `text` is 123 is a 400), so what is forwarded is exactly what was validated. The optional `broker` object (`{"tier", "timeout_s",
"merge"}`) is ours and never forwarded.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator,
                      model_validator)

from mergebroker.errors import InvalidRequest

BROKER_FIELD = "broker"
MAX_TOKENS = 10_000_000
"""No model generates more; a larger budget (1e300) is a mistake that would overflow time arithmetic."""
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


class BrokerOptions(BaseModel):
    """Per-request broker options; everything optional."""

    model_config = ConfigDict(extra="forbid")
    tier: StrictStr | None = None
    timeout_s: float | None = Field(None, gt=0, strict=True)
    merge: StrictBool | None = None


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _text_needs_text(self) -> "_TextPart":
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs a string 'text'")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[_TextPart] | None = None  # "" is allowed (the spec does; replayed tool turns)

    @field_validator("content")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("content must not be an empty list")
        return value


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: StrictBool | None = None  # null is allowed and means false
    n: StrictInt | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2, strict=True)
    top_p: float | None = Field(None, ge=0, le=1, strict=True)
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    stop: StrictStr | list[StrictStr] | None = None
    user: StrictStr | None = None
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
    model: StrictStr = Field(min_length=1)
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    dimensions: StrictInt | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: StrictStr | None = None
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
    # pydantic names the union member it tried ("str", "list[_TextPart]"): not part of the field's path.
    loc = [str(p) for p in err["loc"] if str(p) not in _TYPE_TAGS and "[" not in str(p)]
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
