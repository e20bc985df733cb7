"""The OpenAI request bodies the HTTP ingress accepts (pydantic, strict types).

``CompletionRequest`` (``POST /v1/completions``), ``ChatRequest``
(``POST /v1/chat/completions``) and ``OverrideRequest``
(``POST /v1/speculation/override``). Unknown fields are ignored, as OpenAI clients
send many; the limits that depend on the app config (prompt size, max_tokens, stop
sequences, the override's node_cap) are checked by the API after validation.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.config import BudgetArgs


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Req):
    include_usage: bool = False


class SamplingRequest(_Req):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)


class TextPart(_Req):
    type: Literal["text"]
    text: str


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class OverrideRequest(_Req):
    budget: BudgetArgs | None
