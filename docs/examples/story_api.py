"""Add an API of its own: ``POST /story/continue``, relayed to the engine's ``/v1/completions``.

Its schema, its error shape and how its conversation opens (the story's title) are the
plugin's: the core keys it, parks it, shapes its errors and describes it in
``/openapi.json`` with no edit of its own.
"""

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

import strata_serve


class StoryRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # the rest goes to the engine as it is
    #: Where its parts are: counted, and searched for media.
    message_fields: ClassVar[tuple[str, ...]] = ("illustrations",)

    title: StrictStr = Field(min_length=1)
    prompt: StrictStr
    illustrations: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    stream: StrictBool = False


class StoryErrorDetail(BaseModel):
    status: int
    says: str


class StoryError(BaseModel):
    """The story API's errors: ``{"story_error": {"status", "says"}}``."""

    story_error: StoryErrorDetail


class StoryFormat(strata_serve.ApiFormat):  # the engine's answer is a completion's
    name = "story"
    errors = strata_serve.ErrorShape(
        "story", lambda error: {"story_error": {"status": error.status, "says": error.message}}, StoryError)


STORY = strata_serve.Api(
    "/story/continue", "Continue a story", schema=StoryRequest, route="story", format=StoryFormat(),
    engine_path="/v1/completions",
    opening=lambda body: strata_serve.Opening(user=body["title"]),  # a story is named by its title
    prompt_units=lambda body: [{"title": body["title"]}, body["prompt"]],
    media={"picture": lambda part: ("vision", part.get("url"))},  # checked as the built-in APIs' are
)


@strata_serve.hookimpl
def register_apis():
    return [STORY]
