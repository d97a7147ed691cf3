"""OpenAI request bodies (what the server accepts) and error bodies (what it answers).

Unknown fields are refused (``extra="forbid"``): a parameter the server would ignore is a
400 naming it, never a silently different answer. Types are strict (``"stream": "yes"`` or
``"max_tokens": true`` are 400s, not coerced), and every number is bounded to what the engine
runs, so a request that passes here cannot fail the shared step it joins. OpenAI parameters
with no effect here are accepted only at their neutral values (``n=1``, penalties 0, no
logprobs).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


MAX_STOP_CHARS = 256  # each stop string is searched for on every generated token


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error",
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PolicyOverride(Strict):
    """Per-request attention: ``window`` keys per query on every layer, ``sinks`` pinned."""
    window: int = Field(ge=1)
    sinks: int = Field(default=0, ge=0)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """The sampling and stopping fields both endpoints share."""
    model: str
    max_tokens: Optional[int] = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(default=None, ge=0, lt=2 ** 64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None
    policy: Optional[PolicyOverride] = None
    ignore_eos: bool = False  # keep generating past the model's end-of-turn token (load tests)

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be at least 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return stops

    @model_validator(mode="after")
    def _neutral(self):
        if self.n != 1:
            raise ValueError("only n=1 is served")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (use 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self


class CompletionRequest(Sampling):
    prompt: Union[str, list[int], list[str]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("one prompt per request")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("the prompt is empty")
        if self.echo or self.logprobs is not None or self.suffix is not None or self.best_of not in (None, 1):
            raise ValueError("echo, logprobs, suffix and best_of are not supported")
        return self


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[ContentPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False

    @model_validator(mode="after")
    def _tokens(self):
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ValueError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self


def validation_message(errors: list) -> tuple:
    """``(message, param)`` of pydantic's first error, phrased for an API user."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if e.get("type") == "extra_forbidden":
        return f"unknown field '{param}'", param
    if e.get("type") == "missing":
        return f"missing field '{param}'", param
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{param}: {msg}" if param and not msg.startswith(param) else msg), param
