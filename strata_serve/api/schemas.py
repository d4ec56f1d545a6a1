"""Request bodies, validated before anything reaches the engine.

Only the fields strata-serve relies on are typed; anything else a client sends is
passed through to the engine untouched (``extra="allow"``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator, model_validator

#: The engine keeps token counts in 32-bit integers and refuses larger ones.
INT32_MAX = 2**31 - 1

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")
    #: The fields that hold the conversation's messages (or items), each of which the
    #: engine's chat template renders: counted before validation (``api/checks.py``).
    message_fields: ClassVar[tuple[str, ...]] = ()


#: What each kind of content part must carry. The engine answers a part without it with
#: a 500 ("Failed to parse messages"), which would reach the client as our 502.
_PART_FIELDS = {
    "text": ("text", "a string", lambda v: isinstance(v, str)),
    "image_url": ("image_url", "an object with a string 'url'",
                  lambda v: isinstance(v, dict) and isinstance(v.get("url"), str)),
    "input_audio": ("input_audio", "an object with string 'data' and 'format'",
                    lambda v: isinstance(v, dict) and isinstance(v.get("data"), str)
                    and isinstance(v.get("format"), str)),
}


class ContentPart(_Open):
    type: StrictStr

    @model_validator(mode="after")
    def _carries_what_its_type_needs(self) -> ContentPart:
        if self.type in _PART_FIELDS:
            field, expected, valid = _PART_FIELDS[self.type]
            if not valid((self.model_extra or {}).get(field)):
                raise ValueError(f"a {self.type!r} part needs {field!r}: {expected}")
        return self


class FunctionCall(_Open):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Open):
    id: StrictStr | None = None
    type: Literal["function"]
    function: FunctionCall


class Message(_Open):
    role: Role
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None


class FunctionDefinition(_Open):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class _OneCompletion(_Open):
    """A request the engine answers with completions (``n_cmpl``, alias ``n``: how many).

    The engine runs each extra completion in another slot, over whatever conversation
    that slot holds and behind the service's back: one completion per request.
    """

    n: int | None = None
    n_cmpl: int | None = None

    @field_validator("n", "n_cmpl")
    @classmethod
    def _one(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"{value} completions asked; strata-serve answers one per request (the engine "
                             "would run the others in other slots, over the conversations they hold): "
                             "send one request per completion")
        return value


class _Sampling(_OneCompletion):
    model: StrictStr | None = None
    stream: StrictBool = False
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    message_fields = ("messages",)
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    # 0 is refused, as OpenAI refuses it: the engine writes a token all the same. (A
    # completion keeps 0, which OpenAI's completions take, with ``echo``, to score a prompt.)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[int]


class EmbeddingsRequest(_Open):
    model: StrictStr | None = None
    input: StrictStr | list[StrictStr] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    user: StrictStr | None = None


# -- Anthropic's Messages API ---------------------------------------------------------

#: What each kind of Anthropic content block must carry (the engine answers a text block
#: without its text with a 500).
_ANTHROPIC_BLOCK_FIELDS = {
    "text": ("text", "a string", lambda v: isinstance(v, str)),
    "image": ("source", "an object", lambda v: isinstance(v, dict)),
    "document": ("source", "an object", lambda v: isinstance(v, dict)),
    "tool_use": ("name", "a string", lambda v: isinstance(v, str)),
    "tool_result": ("tool_use_id", "a string", lambda v: isinstance(v, str)),
}


class _TypedPart(_Open):
    """A content part whose ``type`` says which field it must carry (one table per API)."""

    #: type -> (the field it needs, what that field must be, the check)
    required: ClassVar[dict[str, tuple[str, str, Callable[[Any], bool]]]] = {}
    #: What the API calls such a part, for the message.
    noun: ClassVar[str] = "part"
    type: StrictStr

    @model_validator(mode="after")
    def _carries_what_its_type_needs(self) -> _TypedPart:
        rule = self.required.get(self.type)
        if rule is not None:
            field, expected, valid = rule
            if not valid((self.model_extra or {}).get(field)):
                raise ValueError(f"a {self.type!r} {self.noun} needs {field!r}: {expected}")
        return self


class AnthropicBlock(_TypedPart):
    required = _ANTHROPIC_BLOCK_FIELDS
    noun = "block"


class AnthropicTextBlock(_Open):
    type: Literal["text"]
    text: StrictStr


class AnthropicMessage(_Open):
    # "system" among the messages: Claude Code sends its environment so in a session's first
    # request, and the engine takes it (its conversion passes the role on to the template).
    role: Literal["user", "assistant", "system"]
    content: StrictStr | list[AnthropicBlock]


class AnthropicTool(_Open):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None


class _AnthropicPrompt(_Open):
    message_fields = ("messages",)
    model: StrictStr | None = None
    system: StrictStr | list[AnthropicTextBlock] | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class AnthropicMessagesRequest(_AnthropicPrompt, _OneCompletion):
    # Anthropic requires it; without it the engine would write until the context is full.
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stream: StrictBool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    stop_sequences: list[StrictStr] | None = None


class AnthropicCountTokensRequest(_AnthropicPrompt):
    pass


# -- OpenAI's Responses API ------------------------------------------------------------

_RESPONSES_PART_FIELDS = {
    "input_text": ("text", "a string", lambda v: isinstance(v, str)),
    "output_text": ("text", "a string", lambda v: isinstance(v, str)),
    "input_image": ("image_url", "a string", lambda v: v is None or isinstance(v, str)),
}


class ResponsesPart(_TypedPart):
    required = _RESPONSES_PART_FIELDS


class ResponsesItem(_Open):
    type: StrictStr | None = None
    role: StrictStr | None = None
    content: StrictStr | list[ResponsesPart] | None = None


class ResponsesTool(_Open):
    type: StrictStr

    @model_validator(mode="after")
    def _a_function_has_a_name(self) -> ResponsesTool:
        name = (self.model_extra or {}).get("name")
        if self.type == "function" and not (isinstance(name, str) and name):
            raise ValueError("a 'function' tool needs 'name': a non-empty string")  # else the engine's 500
        return self


class ResponsesRequest(_OneCompletion):
    message_fields = ("input",)
    model: StrictStr | None = None
    # Empty, the engine would write from nothing until its limit (chat and messages refuse
    # an empty list too).
    input: Annotated[StrictStr, Field(min_length=1)] | Annotated[list[ResponsesItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    stream: StrictBool = False
    # 0 is refused: the engine writes a token all the same.
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[ResponsesTool] | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: StrictStr | None = None
    user: StrictStr | None = None


# -- the engine's own routes -------------------------------------------------------------

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class InfillChunk(_Open):
    text: StrictStr
    filename: StrictStr | None = None


class InfillRequest(_OneCompletion):
    input_prefix: StrictStr
    input_suffix: StrictStr
    input_extra: list[InfillChunk] | None = None
    prompt: StrictStr | None = None
    stream: StrictBool = False
    n_predict: int | None = Field(None, ge=-1, le=INT32_MAX)
    max_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    cache_prompt: StrictBool | None = None
    # The service chooses the slot: a client's choice would put the request where the
    # core's picture does not expect it. -1 is the engine's "any".
    id_slot: Literal[-1] | None = None


class TokenizeRequest(_Open):
    content: StrictStr | list[StrictStr | TokenId]
    add_special: StrictBool | None = None
    parse_special: StrictBool | None = None
    with_pieces: StrictBool | None = None


class DetokenizeRequest(_Open):
    tokens: list[TokenId]


class ApplyTemplateRequest(_Open):
    message_fields = ("messages",)
    messages: list[Message]


#: Longest file name, in bytes, that file systems take (NAME_MAX); longer ones fail
#: with ENAMETOOLONG in every path operation.
NAME_MAX_BYTES = 255


class SlotFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filename: StrictStr = Field(min_length=1, max_length=NAME_MAX_BYTES)

    @field_validator("filename")
    @classmethod
    def _a_name_the_file_system_takes(cls, value: str) -> str:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError("not valid Unicode text (a lone surrogate)") from None
        if size > NAME_MAX_BYTES:
            raise ValueError(f"{size} bytes in UTF-8; a file name has at most {NAME_MAX_BYTES}")
        if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
            raise ValueError("control characters are not allowed in a file name")
        return value
