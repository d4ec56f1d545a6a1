"""Request bodies, validated before anything reaches the engine.

Only the fields strata-serve relies on are typed; anything else a client sends is
passed through to the engine untouched (``extra="allow"``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

#: The engine keeps token counts in 32-bit integers and refuses larger ones.
INT32_MAX = 2**31 - 1

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Open):
    type: StrictStr


class Message(_Open):
    role: Role
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None


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
