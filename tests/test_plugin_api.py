"""A plugin adds an API of its own through ``register_apis``, and the core serves it like its own.

The toy API continues a story: ``POST /story/continue`` with a ``title`` and the text so
far, relayed to the engine's ``/v1/completions``. Its schema, its error shape and how its
conversation opens (the title) are the plugin's; nothing of the core names it. It gets
keying, parking, its errors in its shape and its entry in ``/openapi.json``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest

import strata_auto_sessions
import strata_serve
from strata_serve.api import SERVICE
from strata_serve.api.conversation import text_key

#: The plugin, as docs/writing-plugins.md shows it.
_SPEC = importlib.util.spec_from_file_location(
    "story_api", Path(__file__).resolve().parent.parent / "docs" / "examples" / "story_api.py")
story_api = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(story_api)
STORY, StoryError, StoryRequest = story_api.STORY, story_api.StoryError, story_api.StoryRequest


class StoryEmbedding:
    """A second API of the same kind, relayed to a path the in-memory engine does not serve."""

    strata_name = "story_embedding"

    @strata_serve.hookimpl
    def register_apis(self, settings):
        return [strata_serve.Api("/story/embedding", "A story's embedding", schema=StoryRequest,
                                 route="story_embedding", format=story_api.StoryFormat(),
                                 engine_path="/v1/embeddings", keyed=False)]


def story(title: str, words: int = 40, **extra):
    text = " ".join(f"{title.split()[-1]}{n} and the sea" for n in range(words))
    return {"title": title, "prompt": f"{title}. {text}", "max_tokens": 3, **extra}


async def test_a_plugins_api_is_keyed_by_its_own_opening(strata_memory_client_factory):
    client = await strata_memory_client_factory(story_api)
    answers = [await client.post("/story/continue", json=story(title)) for title in ("A lighthouse", "A harbour")]
    assert [resp.status for resp in answers] == [200, 200], [await resp.text() for resp in answers]
    assert [resp.headers["X-Strata-Conversation"] for resp in answers] == [text_key("A lighthouse"),
                                                                           text_key("A harbour")]
    engine = client.app[SERVICE].engine
    assert engine.requests[-1]["prompt"].startswith("A harbour."), "relayed to the engine as it was sent"
    assert (await answers[-1].json())["choices"][0]["text"]
    streamed = await client.post("/story/continue", json=story("A harbour", stream=True))
    assert streamed.status == 200 and streamed.headers["Content-Type"] == "text/event-stream"
    assert b"[DONE]" in await streamed.read()


async def test_a_plugins_api_is_parked_and_restored(strata_memory_client_factory, strata_settings_factory):
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await strata_memory_client_factory(strata_auto_sessions, story_api, settings=settings)
    service = client.app[SERVICE]
    for title in ("A lighthouse", "A harbour"):
        assert (await client.post("/story/continue", json=story(title))).status == 200
    back = await client.post("/story/continue", json=story("A lighthouse"))
    assert back.status == 200 and back.headers["X-Strata-State"] == "disk", "the lighthouse was parked, then restored"
    stats = service.state["auto_sessions"].stats
    assert stats.saves == 2 and stats.restores == 1
    sidecar = json.loads((Path(service.engine.info.slot_save_path)
                          / f"auto-{text_key('A harbour')}.json").read_text())
    assert sidecar["prompt"]["units"] == 2, "the API's own prompt units: its title and its text"


async def test_a_plugins_api_answers_errors_in_its_own_shape(strata_memory_client_factory):
    client = await strata_memory_client_factory(story_api, StoryEmbedding())
    refused = [
        await client.post("/story/continue", json={"title": "", "prompt": 5}),  # its schema
        await client.post("/story/continue", data="title", headers={"Content-Type": "text/plain"}),  # before it
        await client.post("/story/continue/nothing-here", json=story("A lighthouse")),  # beneath its path
        await client.post("/story/embedding", json=story("A lighthouse")),  # its engine lacks the route
        await client.post("/story/continue", json=story("A lighthouse", illustrations=[  # its media parts
            {"type": "picture", "url": "http://169.254.169.254/latest/meta-data"}])),
    ]
    bodies = [await resp.json() for resp in refused]
    assert [resp.status for resp in refused] == [400, 415, 404, 404, 400], bodies
    assert "server.fetch_media_urls" in bodies[4]["story_error"]["says"]
    for resp, body in zip(refused, bodies):
        assert StoryError.model_validate(body).story_error.status == resp.status
    assert "title" in bodies[0]["story_error"]["says"] and "not supported" in bodies[3]["story_error"]["says"]
    chat = await client.post("/v1/chat/completions", json={"messages": []})
    assert (await chat.json())["error"]["type"] == "invalid_request_error", "the built-in APIs keep theirs"


async def test_a_plugins_api_is_described_in_openapi(strata_memory_client_factory):
    client = await strata_memory_client_factory(story_api, StoryEmbedding())
    document = await (await client.get("/openapi.json")).json()
    operation = document["paths"]["/story/continue"]["post"]
    assert operation["summary"] == "Continue a story"
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/StoryRequest")
    assert operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/StoryError")
    assert {"StoryRequest", "StoryError"} <= set(document["components"]["schemas"])
    assert "/story/embedding" not in document["paths"], "the engine does not serve what it is relayed to"


async def test_an_api_on_a_taken_path_or_route_is_refused_and_logged(strata_memory_client_factory, caplog):
    class Taker:
        strata_name = "taker"

        @strata_serve.hookimpl
        def register_apis(self):
            return [strata_serve.Api("/v1/chat/completions", "A second chat", schema=StoryRequest, route="taken"),
                    strata_serve.Api("/story/again", "A second chat", schema=StoryRequest, route="chat"),
                    strata_serve.Api("/health", "Not here", method="GET"),
                    strata_serve.Api("/story/slots", "Not this name", schema=StoryRequest, route="slots")]

    with caplog.at_level(logging.ERROR):
        client = await strata_memory_client_factory(story_api, Taker())
    refusals = [r.getMessage() for r in caplog.records if "plugin taker: its API was refused" in r.getMessage()]
    assert len(refusals) == 4, refusals
    resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2})
    assert resp.status == 200 and resp.headers["X-Strata-Conversation"] == text_key("hi"), "still the built-in chat"
    assert (await client.post("/story/again", json=story("A lighthouse"))).status == 404


def test_a_request_is_given_its_api_and_read_as_the_built_in_one_its_route_names_without_it():
    plain = strata_serve.StrataRequest(route="chat", body={})
    assert plain.api is None, "a request looks nothing up itself"
    assert strata_serve.api_of(plain).path == "/v1/chat/completions"
    assert strata_serve.api_of(strata_serve.StrataRequest(route="story", body={}, api=STORY)) is STORY
    assert strata_serve.api_of(strata_serve.StrataRequest(route="story", body={})) is None, "no built-in API has it"
    assert strata_serve.opening(strata_serve.StrataRequest(route="story", body=story("A lighthouse"))) is None
    with pytest.raises(ValueError, match="is not the route of /story/continue"):
        strata_serve.StrataRequest(route="chat", body={}, api=STORY)


async def test_a_plugins_api_is_relayed_to_the_real_engine_and_parked(strata_client_factory, strata_settings_factory):
    settings = strata_settings_factory(plugins={"auto_sessions": {"min_tokens": 100, "idle_save_s": 0}})
    client = await strata_client_factory(strata_auto_sessions, story_api, settings=settings)
    states = []
    for title in ("A lighthouse", "A harbour", "A lighthouse"):
        resp = await client.post("/story/continue", json=story(title, temperature=0))
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["timings"]["prompt_n"] > 0, "llama-server's own answer"
        states.append(resp.headers["X-Strata-State"])
    assert states == ["none", "none", "disk"], states
    assert client.app[SERVICE].state["auto_sessions"].stats.restores == 1


class Placed:
    """Writes down whether each request ran in the slot the service chose."""

    strata_name = "placed"

    def __init__(self) -> None:
        self.pinned: dict[str, bool] = {}

    @strata_serve.hookimpl
    def pre_request(self, request):
        self.pinned[request.route] = request.pinned


async def test_a_plugins_api_is_placed_in_a_slot_by_the_engine_path_it_is_relayed_to(strata_client_factory,
                                                                                   strata_settings_factory):
    # llama-server honours the slot chosen on /v1/completions: so it does for the story API,
    # which no list of the backend names; on /v1/messages it does not, and that holds every slot.
    placed = Placed()
    settings = strata_settings_factory(engine={"parallel": 2, "ctx_size": 4096})
    client = await strata_client_factory(story_api, placed, settings=settings)
    resp = await client.post("/story/continue", json=story("A lighthouse", stream=True))
    assert resp.status == 200 and "X-Strata-Slot" in resp.headers, "a stream names its slot when it is pinned"
    await resp.read()
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200, await resp.text()
    assert placed.pinned == {"story": True, "messages": False}
