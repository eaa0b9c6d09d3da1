"""OpenAI request bodies (the subset orbitflow serves) as pydantic models.

Unknown fields are ignored, as OpenAI clients send many optional ones; fields we accept are checked
strictly enough that a wrong type or value is a 400 naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

_MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    include_usage: bool = Field(default=False, strict=True)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, strict=True)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True)
    top_k: StrictInt = Field(default=0, ge=0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: Literal[1] = 1
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(default=False, strict=True)

    @field_validator("stop")
    @classmethod
    def _few_stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > _MAX_STOP_STRINGS:
            raise ValueError(f"at most {_MAX_STOP_STRINGS} stop strings are supported")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = Field(default=16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Prompt) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("exactly one prompt per request is supported")
            value = value[0]
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
