"""The HTTP API's bodies (pydantic): what each route takes and what it answers.

Requests (strict types): ``CompletionRequest`` (``POST /v1/completions``),
``ChatRequest`` (``POST /v1/chat/completions``), ``OverrideRequest``
(``POST /v1/speculation/override``) and ``PricingRequest``
(``POST /v1/speculation/pricing``). Unknown fields are ignored, as OpenAI clients send
many; OpenAI fields that would change the output in a way we cannot honour are declared,
and ``unsupported()`` names the first one a request sets (the API answers 400). The
limits that depend on the app config (prompt size, max_tokens, n, stop sequences, the
override's node_cap) are checked by the API after validation.

Responses are described for the OpenAPI document (``deployments.http.openapi``); the API
builds them as plain dicts (``deployments.http.responses``).
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.config import BudgetArgs


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Req):
    include_usage: bool = False


class SamplingRequest(_Req):
    model: str = Field(description="The served model's name (`GET /v1/models`); another name is a 404.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64,  # what torch.Generator.manual_seed takes
                             description="Makes sampling reproducible: the same prompt, parameters and seed give "
                                         "the same tokens whatever the load, and a stream resumed after a replica "
                                         "failure goes on with the tokens it would have had; choice i > 0 of `n` "
                                         "samples with a seed derived from this one.")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=128, description="Independent choices (at most `limits.max_n` of the deployment).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Only 0 is supported.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Only empty is supported.")
    user: str | None = Field(None, description="Accepted and ignored.")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported(self) -> str | None:
        """The first field set to a value we cannot honour (None: all can be)."""
        if self.presence_penalty != 0.0:
            return "presence_penalty"
        if self.frequency_penalty != 0.0:
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None


_Prompt = (Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
           | Annotated[list[str], Field(min_length=1)])


class CompletionRequest(SamplingRequest):
    prompt: _Prompt = Field(description="Text, token ids, or a list of one text.")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5,
                                 description="Each generated token's log-probability under the target, and those "
                                             "of this many likeliest tokens.")
    echo: bool = Field(False, description="Only false is supported.")
    best_of: int | None = Field(None, ge=1, le=128, description="Only null or equal to n.")
    suffix: str | None = Field(None, description="Only null is supported.")

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()


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
    logprobs: bool = Field(False, description="Each generated token's log-probability under the target.")
    top_logprobs: int | None = Field(None, ge=0, le=20,
                                     description="With `logprobs`: the log-probabilities of this many likeliest tokens "
                                                 "at each position.")
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported: only null or empty.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only null, \"none\" or \"auto\" (no tools).")
    response_format: dict[str, Any] | None = Field(None, description="Only null or {\"type\": \"text\"}.")

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"
        if self.response_format is not None and self.response_format != {"type": "text"}:
            return "response_format"
        return super().unsupported()


class OverrideRequest(_Req):
    budget: BudgetArgs | None = Field(description="The budget every replica runs, or null to release the override.")
    fixed: bool = Field(False, description="Verify the budget as it is: a replica's per-step allocation "
                                           "(which may only cut it) pauses while this override is pinned.")


class PricingRequest(_Req):
    cluster: bool = Field(description="Price every replica's speculation on the cluster's load (true: the "
                                      "controller's price theta) or each replica on its own queue (false).")


# -- responses (documentation of what deployments.http.responses builds) --------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every 4xx and 5xx: an OpenAI error object. 5xx bodies name an error id only."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculationStats(BaseModel):
    """How the request was decoded: speculative rounds (target forwards), draft tree nodes
    verified, draft tokens accepted (all choices together when n > 1)."""

    rounds: int
    drafted_tokens: int | None
    accepted_tokens: int
    mean_tree_size: float | None
    accepted_per_round: float


class CompletionLogprobs(BaseModel):
    """The legacy completions form: one entry per generated token in each list."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculation: SpeculationStats


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """One entry per generated token."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpeculationStats


class CompletionChunk(BaseModel):
    """One ``data:`` event of a streamed completion (the last carries ``usage`` and
    ``speculation`` and no choices, with ``stream_options.include_usage``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: SpeculationStats | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculation: SpeculationStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class OverrideResponse(BaseModel):
    override: BudgetArgs | None
    fixed: bool = False


class PricingResponse(BaseModel):
    cluster: bool


class SpeculationStatus(BaseModel):
    """The controller's view: each replica's assigned and applied budget, load and recent
    tree statistics; cluster load; calibration; acceptance per tree size; counters."""

    model_config = ConfigDict(extra="allow")

    model: str
    replicas: dict[str, dict[str, Any]]
    cluster: dict[str, Any]
    override: BudgetArgs | None
    override_fixed: bool = False
    price_source: Literal["cluster", "local"] = Field(
        description="What the controller prices each replica on (`POST /v1/speculation/pricing`); each "
                    "replica's `price_source` is the one its running budget was priced on.")
    calibration: dict[str, Any]
    acceptance: dict[str, Any]
    draft_node_s: float | None
    registrations: int
    dropped: int
    uptime_s: float
    counters: dict[str, float]
