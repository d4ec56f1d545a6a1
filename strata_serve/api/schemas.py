"""Request bodies, validated before anything reaches the engine.

Only the fields strata-serve relies on are typed; anything else a client sends is
passed through to the engine untouched (``extra="allow"``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator, model_validator

#: The engine keeps token counts in 32-bit integers and refuses larger ones.
INT32_MAX = 2**31 - 1

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


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


class _Sampling(_Open):
    model: StrictStr | None = None
    stream: StrictBool = False
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    n: int | None = Field(None, ge=1, le=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[int]


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
