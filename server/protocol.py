"""Pydantic mirror of the OpenAI API requests the server supports, plus its extensions (their answers:
``server.completion_objects``).

Contract: request models are strict (``"8"`` where an int belongs fails) and ignore unknown fields
(``server.request_base.StrictModel``). Each rule of the API is written once, here (the chat messages in
``server.messages``), and is both checked and stated in the JSON schema the OpenAPI document takes from
these models: the field types the models share (``FunctionName``, ``Temperature``, ``Seed``, ``StopSequences``,
``TokenId``, ...) carry their bounds (``Field(ge=..., pattern=...)``, checked by pydantic); a rule the endpoint
checks in code, in its place among the request's checks and with its own message (non-empty prompts, no
``suffix``, a token id's range), states its schema with ``described``; a limit of the configuration (``max_n``,
``max_stop_strings``, the lookahead maxima, the vocabulary size, the served names) with ``configured``, whose
values ``server.openapi`` fills in (checked in ``server.serving``); a rule across fields with ``when`` in the
model's ``json_schema_extra`` (``ZERO_MAX_TOKENS_NEEDS_ECHO``, ...).
Extensions: request fields ``lookahead`` (``LookaheadRequest``), ``top_k``, ``stream_steps`` and vLLM's
sampling fields ``min_p``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos``; with
``stream_steps`` a stream's content and finish chunks carry one more top-level object, ``step``
(``server.completion_objects.StepInfo``);
vLLM's chat template fields (``ChatTemplateFields``) and its ``/tokenize`` and ``/detokenize`` bodies, which
refuse unknown fields, as ``/v1/memory/corpus``'s body does (``CorpusRequest``, answered by ``CorpusAdded``;
``GET /v1/memory`` by ``MemoryInfo``). Logprobs: chat's ``logprobs`` + ``top_logprobs`` give
``choices[].logprobs.content[]`` (``ChoiceLogprobs``), completions' ``logprobs: int`` the legacy
``CompletionLogprobs``; both the raw model's (before temperature, top-k, top-p), with at most ``MAX_TOP_LOGPROBS``
alternatives. Predicted outputs: chat's and completions' ``prediction`` (``Prediction``) give
``usage.completion_tokens_details``. Completions'
``prompt`` is a string, a list of strings, a list of token ids or a list of lists of token ids (one prompt per
item; ``CompletionRequest.prompt_list``); with several prompts and ``n`` each prompt has ``n`` choices,
``index = prompt_index * n + j``. With ``echo`` a choice's text (and legacy logprobs) start with its prompt's,
the first prompt token's logprob and top alternatives null (``CompletionLogprobs``).
Chat messages: ``server.messages``. ``HealthStatus`` is ``GET /health``'s answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from decoding.params import MAX_TOP_LOGPROBS
from server.config import REQUEST_LOOKAHEAD
from server.messages import (
    AssistantMessage,
    ChatMessage,
    FunctionCall,
    TextContentPart,
    ToolCall,
    ToolMessage,
)
from server.request_base import StrictModel, configured, described

FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function (and json_schema) names


def _non_empty_stops(stop: str | list[str]) -> str | list[str]:
    if any(not item for item in ([stop] if isinstance(stop, str) else stop)):
        raise ValueError("stop sequences must be non-empty strings")
    return stop


# The field types the request models share, each rule written once: its check and its JSON schema.
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
ServedModel = Annotated[str, configured(enum="served_models")]  # another name: 404 (``serving.check_model``)
MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]  # top_p, min_p
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence_penalty, frequency_penalty
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # int64, as OpenAI (and torch) take it
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
ParallelToolCalls = Annotated[bool, Field(description="false: at most one call per reply; true: 1 to 8.")]
Choices = Annotated[int, configured(maximum="max_n")]  # n and best_of (``serving.check_choices``)
Text = Annotated[str, described(minLength=1)]  # non-empty: a prompt (completions.prompts), a stop (_non_empty_stops)
StopSequences = Annotated[Text | Annotated[list[Text], configured(maxItems="max_stop_strings")],
                          AfterValidator(_non_empty_stops)]
TokenId = Annotated[int, described(minimum=0), configured(maximum="max_token_id")]  # below the vocabulary size
TokenIds = Annotated[list[TokenId], described(minItems=1)]  # one prompt's ids
Prompt = (  # OpenAI's four forms, each prompt non-empty (``completions.prompts``)
    Text | Annotated[list[Text], described(minItems=1)] | TokenIds | Annotated[list[TokenIds], described(minItems=1)]
)
LogitBias = Annotated[  # token id keys (``serving.resolve_logit_bias``), biases in the decoder's range
    dict[str, Annotated[float, described(minimum=-100, maximum=100)]], described(propertyNames={"pattern": "^[0-9]+$"})
]


def when(condition: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a cross-field rule: a body whose fields match ``condition`` (field -> schema, each sent)
    has fields that match ``then`` (each sent).

    >>> when({"max_tokens": {"const": 0}}, {"echo": {"const": True}})["then"]
    {'properties': {'echo': {'const': True}}, 'required': ['echo']}
    """
    return {"if": {"properties": condition, "required": list(condition)},
            "then": {"properties": then, "required": list(then)}}


# The cross-field rules the request models state in their schema (``json_schema_extra``); each is checked where
# the comment says, in its place among the request's checks.
CONTINUE_EXCLUDES_GENERATION_PROMPT = when(  # chat.template_options
    {"continue_final_message": {"const": True}}, {"add_generation_prompt": {"const": False}})
TOOL_CHOICE_NEEDS_TOOLS = when(  # tools.resolve
    {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
    {"tools": {"type": "array", "minItems": 1}},
)
TOP_LOGPROBS_NEED_LOGPROBS = when({"top_logprobs": {"type": "integer"}}, {"logprobs": {"const": True}})  # chat.check
ZERO_MAX_TOKENS_NEEDS_ECHO = when({"max_tokens": {"const": 0}}, {"echo": {"const": True}})  # completions.check


class Prediction(StrictModel):
    """Predicted outputs: text the client expects the completion to resemble (e.g. a file it asks to edit).

    ``type`` must be ``"content"``; ``content`` is a string or text parts (joined without separator). Lookahead
    verifies it as a free draft: it changes how fast the completion comes, never what it is.
    """

    type: Annotated[str, described(const="content")]
    content: str | list[TextContentPart]

    @field_validator("type", mode="before")
    @classmethod
    def _content_only(cls, value: Any) -> Any:
        if value == "content" or not isinstance(value, str):
            return value
        raise PydanticCustomError("unknown_prediction", "unknown prediction type '{kind}'; expected 'content'",
                                  {"kind": value})

    def text(self) -> str:
        """The predicted text as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``: OpenAI's ``name`` (1-64 letters, digits, ``_`` or ``-``), ``description``,
    ``schema`` (a JSON schema object; absent: any JSON object) and ``strict`` (the output always matches here,
    strict or not: the schema is enforced by a grammar, see ``decoding.grammar``)."""

    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON schema; absent: any JSON object.")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    model_config = ConfigDict(json_schema_extra=when({"type": {"const": "json_schema"}},
                                                     {"json_schema": {"type": "object"}}))

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class FunctionDefinition(StrictModel):
    """A tool's function: ``name`` (1-64 letters, digits, ``_`` or ``-``), ``description``, ``parameters`` (a
    JSON schema of its arguments object; absent: any object) and ``strict`` (calls always match here, strict or
    not, when ``tool_choice`` forces a call: see ``server.tools``)."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object; absent: any "
                                              "object. One the grammar cannot enforce is a 400 naming "
                                              "tools[i].function.parameters.")
    strict: bool | None = None


class Tool(StrictModel):
    """``tools[i]``: OpenAI's ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """``tool_choice`` naming the one function to call: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(StrictModel):
    include_usage: bool = False


LookaheadRequest = create_model(  # the knobs a request may set are the config's REQUEST_LOOKAHEAD, declared there
    "LookaheadRequest",
    __base__=StrictModel,
    __doc__="""Extension: per-request lookahead settings; each field falls back to the server's configured default
    (``enabled``, and the integers of ``server.config.REQUEST_LOOKAHEAD``: W, N and G).

    ``shared_memory: false`` opts the request out of the server-wide n-gram memory: it neither draws candidates
    from it nor adds its completion to it.
    """,
    enabled=(bool | None, None),
    **{name: (Annotated[int, configured(minimum=f"min_{name}", maximum=f"max_{name}")] | None, None)
       for name in REQUEST_LOOKAHEAD},
    shared_memory=(bool | None, None),
)


class GenerationFields(StrictModel):
    """Fields shared by chat and text completions."""

    model: ServedModel | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: int | None = Field(None, ge=0)
    seed: Seed | None = None
    stop: StopSequences | None = None
    n: Annotated[Choices, Field(ge=1)] | None = Field(
        None, description="Choices per prompt, decoded side by side; choice j samples with seed + j.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = Field(None, description="token id (a string) -> bias added to its logit at every "
                                         "position")
    min_p: Probability | None = None
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    user: str | None = None
    lookahead: LookaheadRequest | None = None
    stream_steps: bool | None = False
    cache_prompt: bool = True

    def stop_sequences(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        """The completion length the client asked for, if any."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def include_steps(self) -> bool:
        """Extension: stream chunks carry the ``step`` object."""
        return bool(self.stream and self.stream_steps)


class ChatTemplateFields(StrictModel):
    """Extension (vLLM's names): how the conversation is rendered. ``continue_final_message`` continues the last
    (assistant) message instead of starting a new turn, so it excludes ``add_generation_prompt``;
    ``chat_template_kwargs`` are extra variables of the chat template (checked in ``server.serving``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra chat template variables; a variable the server sets itself is a 400.")


class ChatCompletionRequest(ChatTemplateFields, GenerationFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        CONTINUE_EXCLUDES_GENERATION_PROMPT, TOOL_CHOICE_NEEDS_TOOLS, TOP_LOGPROBS_NEED_LOGPROBS]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = Field(None, description="Return each generated token's logprob (the raw model's, before "
                                  "temperature / top-k / top-p) in choices[].logprobs.")
    top_logprobs: TopLogprobs | None = Field(None, description="Most likely alternatives per token; needs logprobs: "
                                             "true.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call; see docs/api.md for how they "
                                     "reach a template without tool support.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none (tools left out of the prompt), auto (default with tools: text, or a call enforced by "
        "a grammar once the reply starts with '{'), required or a named function (a call is enforced). A named "
        "function must be among the tools (else 400).")
    parallel_tool_calls: ParallelToolCalls = True
    response_format: ResponseFormat | None = Field(
        None, description="Structured output: json_object (any JSON object) or json_schema (JSON matching the "
        "schema), enforced by a grammar at every generated token (strict or not). A schema the grammar cannot enforce "
        "is a 400 naming response_format.json_schema.schema.")
    prediction: Prediction | None = None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationFields):
    """``/v1/completions``: ``max_tokens`` may be 0 together with ``echo`` (the prompt and its logprobs only;
    checked in ``server.serving``); ``best_of`` is accepted when null or equal to ``n``."""

    model_config = ConfigDict(json_schema_extra={"allOf": [ZERO_MAX_TOKENS_NEEDS_ECHO]})

    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate; 0 only with echo (the prompt alone).")
    echo: bool | None = Field(None, description="Prepend each prompt to its choices' text.")
    logprobs: TopLogprobs | None = Field(
        None, description="Return each token's logprob and this many alternatives (legacy shape: tokens, "
        "token_logprobs, top_logprobs, text_offset); with echo, the prompt's tokens first (the first one's logprob "
        "null).",
    )
    best_of: Annotated[Choices, described(minimum=1)] | None = Field(
        None, description="Only null or equal to n (choices are not ranked).")
    suffix: Annotated[str, described(maxLength=0)] | None = None
    prediction: Prediction | None = None

    def prompt_list(self) -> list[str] | list[list[int]]:
        """``prompt`` as a list of prompts, each a string or token ids (an empty list stays empty).

        >>> CompletionRequest(prompt=[1, 2]).prompt_list(), CompletionRequest(prompt="a").prompt_list()
        ([[1, 2]], ['a'])
        """
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(item, int) for item in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``, exactly one. Unknown fields are refused
    (400 naming them), since a misspelt option here would silently change the count."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "allOf": [CONTINUE_EXCLUDES_GENERATION_PROMPT], "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
    })

    model: ServedModel | None = None
    prompt: str | SkipJsonSchema[None] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | SkipJsonSchema[None] = None
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``: token ids (each below the vocabulary size) to text."""

    model_config = ConfigDict(extra="forbid")

    model: ServedModel | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """``GET /tokenizer_info`` (vLLM's): what a client that tokenizes through the server needs."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool | None
    chat_template: str | None
    model_max_length: int


class CorpusRequest(StrictModel):
    """``POST /v1/memory/corpus`` (extension): texts (a codebase's files, documents) added to the server-wide n-gram
    memory, each tokenized without special tokens. Unknown fields are refused (400 naming them)."""

    model_config = ConfigDict(extra="forbid")

    documents: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, description="Texts to add, each non-empty; a long one enters as several memory documents."
    )


class MemoryInfo(BaseModel):
    """``GET /v1/memory`` (extension): the server-wide n-gram memory's stored tokens and documents, of at most
    ``capacity`` tokens (the oldest documents are evicted first); ``enabled`` false, all zero, without one."""

    object: Literal["memory"] = "memory"
    enabled: bool
    tokens: int
    documents: int
    capacity: int


class CorpusAdded(BaseModel):
    """``POST /v1/memory/corpus``'s answer: the memory ``documents`` and ``tokens`` added, and the memory after."""

    object: Literal["memory.corpus"] = "memory.corpus"
    documents: int
    tokens: int
    memory: MemoryInfo


class HealthStatus(BaseModel):
    """``GET /health``: ``{"status": "ok"}`` when ready; otherwise the state: loading, warming, draining or failed."""

    status: str


def protocol_field_names() -> set[str]:
    """Every request field name, nested ones included (to render validation error locations)."""
    names: set[str] = set()
    for model in (ChatCompletionRequest, CompletionRequest, AssistantMessage, ToolMessage, TextContentPart,
                  StreamOptions, LookaheadRequest, Prediction, TokenizeRequest, DetokenizeRequest, CorpusRequest,
                  ResponseFormat, JsonSchemaFormat, Tool, FunctionDefinition, NamedToolChoice, NamedFunction, ToolCall,
                  FunctionCall):
        names.update(field.alias or name for name, field in model.model_fields.items())
    return names
