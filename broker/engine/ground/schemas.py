"""Request bodies at the HTTP edge: pydantic validation, OpenAI-style 400s, broker-only fields stripped.

Validation only decides whether a body is acceptable; the body that travels on is the caller's own dict,
so unknown fields reach the upstream untouched. Known fields are validated strictly (no coercion: `"stream":
"false"` or a text part whose `text` is 123 is a 400), so what is forwarded is exactly what was validated,
with one exception JSON Schema makes too: an integer field takes a whole-number float (`"max_tokens": 50.0`),
forwarded as the integer it is. Known numeric fields are range-checked as the spec states them, and `tools`
and `tool_choice` are checked for shape (`broker.engine.tool_shapes`). The optional `broker` object
(`{"tier", "timeout_s", "merge"}`) is ours and never forwarded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from mergebroker.broker.engine.ground.tool_shapes import check_tool_choice, check_tools
from mergebroker.errors import InvalidRequest

BROKER_FIELD = "broker"
MAX_TOKENS = 10_000_000
"""No model generates more; a larger budget (1e300) is a mistake that would overflow time arithmetic."""
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _whole_number(value: Any) -> Any:
    """A whole-number float as the integer it is (JSON Schema's `integer` accepts 50.0); anything else as given."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


WholeInt = Annotated[StrictInt, BeforeValidator(_whole_number)]
"""An integer field: an int, or a float with no fractional part; never a bool or a numeric string."""
_WHOLE_FIELDS = frozenset({"n", "max_tokens", "max_completion_tokens", "top_logprobs", "seed", "dimensions"})


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
    def _text_needs_text(self) -> _TextPart:
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
    n: WholeInt | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2, strict=True)
    top_p: float | None = Field(None, ge=0, le=1, strict=True)
    presence_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    logprobs: StrictBool | None = None
    top_logprobs: WholeInt | None = Field(None, ge=0, le=20)
    logit_bias: dict[str, Annotated[WholeInt, Field(ge=-100, le=100)]] | None = None
    seed: WholeInt | None = None
    max_tokens: WholeInt | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: WholeInt | None = Field(None, ge=1, le=MAX_TOKENS)
    stop: StrictStr | list[StrictStr] | None = None
    parallel_tool_calls: StrictBool | None = None
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
    dimensions: WholeInt | None = Field(None, ge=1)
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
    parsed, forward = _parse(ChatRequest, body)
    check_tools(forward.get("tools"))
    check_tool_choice(forward.get("tool_choice"))
    return parsed, forward


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
    forward = {k: _whole_number(v) if k in _WHOLE_FIELDS else v for k, v in body.items() if k != BROKER_FIELD}
    if isinstance(forward.get("logit_bias"), dict):
        forward["logit_bias"] = {k: _whole_number(v) for k, v in forward["logit_bias"].items()}
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
        problem = str(err["ctx"]["error"]) if kind == "value_error" and "error" in err.get("ctx", {}) else err["msg"]
        message = f"Invalid value for '{param}': {problem}." if param else problem
    return InvalidRequest(message, param=param, code="missing_required_parameter" if kind == "missing" else
                          "invalid_value")
