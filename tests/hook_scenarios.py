"""For every hook, a run of a real server that reaches it, and what must hold whatever the plugin does.

The server is strata-serve's own, on the in-memory engine but for the hooks that need the
real one (:data:`REAL_ENGINE_HOOKS`).

Used twice: ``tests/test_plugins.py`` registers a plugin whose one hook raises (the
user's request must go on), and ``tests/test_docs.py`` one whose hook records its
call (every hook must be reached, with every documented argument). A hook added to
``hookspecs.py`` without a scenario here fails both.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Awaitable, Callable

from aiohttp import web

import strata_serve
from strata_serve import hookspecs
from strata_serve.api import SERVICE
from strata_serve.config import ConfigError, Settings
from strata_serve.plugins import call_each_sync, get_plugin_manager
from strata_serve.testing import chat_body, conversation

HOOKS = {name: fn for name, fn in vars(hookspecs).items()
         if inspect.isfunction(fn) and hasattr(fn, "strata_serve_spec")}


@dataclass
class Env:
    """What a scenario gets: ``await client(*plugins, settings=None)`` and ``settings(**sections)``."""

    client: Callable[..., Awaitable[Any]]
    settings: Callable[..., Settings]
    recorder: Any
    #: Set by the on_config scenario: the refusal, when the plugin raised.
    refused: ConfigError | None = field(default=None)


#: The hooks whose scenario runs on the real engine: the in-memory engine is itself chosen
#: through ``engine_backend`` (first, and the first answer wins), so a plugin's
#: implementation would never be asked there. Every other scenario is about what the core
#: does with a plugin's hook, which the in-memory engine shows in milliseconds.
REAL_ENGINE_HOOKS = frozenset({"engine_backend"})


def client_factory_for(hook: str, real: Callable[..., Awaitable[Any]],
                       memory: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """The test client factory ``hook``'s scenario runs on: see :data:`REAL_ENGINE_HOOKS`."""
    return real if hook in REAL_ENGINE_HOOKS else memory


Scenario = Callable[[Env, object], Awaitable[None]]
SCENARIOS: dict[str, Scenario] = {}


def scenario(*hooks: str):
    def register(run: Scenario) -> Scenario:
        for hook in hooks:
            SCENARIOS[hook] = run
        return run

    return register


def hook_plugin(hook: str, body: Callable[..., Any]) -> object:
    """A plugin implementing only ``hook``, with every argument its spec documents.

    ``body(**arguments)`` runs on each call; ``plugin.calls`` holds the arguments of each.
    """
    names = list(inspect.signature(HOOKS[hook]).parameters)

    def record(self, arguments: dict[str, Any]) -> Any:
        self.calls.append(arguments)
        return body(**arguments)

    # pluggy reads the arguments an implementation wants from its code: write it out.
    source = (f"def {hook}(self, {', '.join(names)}):\n"
              f"    return record(self, {{{', '.join(f'{n!r}: {n}' for n in names)}}})\n")
    namespace: dict[str, Any] = {"record": record}
    exec(source, namespace)
    impl = namespace[hook]
    plugin = type(f"Only_{hook}", (), {hook: strata_serve.hookimpl(impl)})()
    plugin.strata_name = f"only_{hook}"
    plugin.calls = []
    return plugin


async def answered(client, text: str = "still answered") -> dict:
    resp = await client.post("/v1/chat/completions", json=chat_body(text))
    assert resp.status == 200, await resp.text()
    return await resp.json()


@scenario("engine_backend", "on_startup", "on_engine_start", "conversation_key", "on_arrival", "pre_request",
          "post_request")
async def request_goes_on(env: Env, plugin: object) -> None:
    client = await env.client(plugin, env.recorder)
    await answered(client)
    assert env.recorder.outcomes[-1].status == "ok"
    assert env.recorder.keys[-1] is not None, "the default key still applies"


@scenario("on_shutdown")
async def other_plugins_still_stop(env: Env, plugin: object) -> None:
    # Registered last, the plugin is called first: the recorder after it must still run.
    client = await env.client(env.recorder, plugin)
    await answered(client)
    await client.app[SERVICE].shutdown()
    assert env.recorder.events[-1][0] == "shutdown"


class StillHere:
    strata_name = "still_here"

    @strata_serve.hookimpl
    def register_routes(self):
        async def handle(request):
            return web.json_response({"here": True})

        return [web.get("/still-here", handle)]


@scenario("register_routes")
async def other_routes_still_served(env: Env, plugin: object) -> None:
    client = await env.client(StillHere(), plugin)
    resp = await client.get("/still-here")
    assert resp.status == 200 and await resp.json() == {"here": True}
    await answered(client)


class AlsoHere:
    strata_name = "also_here"

    @strata_serve.hookimpl
    def register_apis(self):
        from pydantic import BaseModel

        class Echo(BaseModel):
            prompt: str

        return [strata_serve.Api("/also-here", "A completion on a path of its own", schema=Echo, route="also_here",
                                 engine_path="/v1/completions")]


@scenario("register_apis")
async def other_apis_still_served(env: Env, plugin: object) -> None:
    client = await env.client(AlsoHere(), plugin)
    resp = await client.post("/also-here", json={"prompt": "Still here", "max_tokens": 2})
    assert resp.status == 200 and (await resp.json())["choices"], await resp.text()
    await answered(client)


@scenario("collect_stats")
async def other_stats_still_collected(env: Env, plugin: object) -> None:
    client = await env.client(plugin, env.recorder)
    await answered(client)
    service = client.app[SERVICE]
    reported = dict(call_each_sync(service.pm, "collect_stats", service=service))
    assert reported["recorder"] == {"requests": 1}


class Counted:
    strata_name = "counted"

    @strata_serve.hookimpl
    def collect_metrics(self):
        return [strata_serve.Metric("answers", "Answers counted", "counter", 1)]


@scenario("collect_metrics")
async def other_metrics_still_collected(env: Env, plugin: object) -> None:
    client = await env.client(plugin, Counted())
    await answered(client)
    collected = strata_serve.plugin_metrics(client.app[SERVICE])
    assert collected["counted"] == [strata_serve.Metric("answers", "Answers counted", "counter", 1)]


class Unwell:
    strata_name = "unwell"

    @strata_serve.hookimpl
    def collect_degraded(self):
        return "its store does not answer"


@scenario("collect_degraded")
async def other_reasons_still_reported(env: Env, plugin: object) -> None:
    client = await env.client(plugin, Unwell())
    await answered(client)
    resp = await client.get("/health")
    assert resp.status == 200, await resp.text()
    reported = await resp.json()
    assert reported["status"] == "degraded" and reported["degraded"]["unwell"] == "its store does not answer"


@scenario("engine_verdict")
async def parking_still_saves(env: Env, plugin: object) -> None:
    import strata_auto_sessions

    settings = env.settings(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await env.client(strata_auto_sessions, plugin, settings=settings)
    a, b = conversation("verdict-a"), conversation("verdict-b")
    for messages in (a, b):  # the switch to b parks a, asking for a verdict first
        resp = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert resp.status == 200, await resp.text()
    from strata_serve.hook_types import StrataRequest

    service = client.app[SERVICE]
    key = service.conversation_key(StrataRequest(route="chat", body={"messages": a}))
    assert (Path(service.engine.info.slot_save_path) / f"auto-{key}.bin").is_file(), "a was parked"


@scenario("pre_slot_action", "post_slot_action")
async def a_slot_action_still_parks_first(env: Env, plugin: object) -> None:
    import strata_auto_sessions

    settings = env.settings(plugins={"auto_sessions": {"min_tokens": 100}})
    client = await env.client(strata_auto_sessions, plugin, settings=settings)
    a = conversation("by-hand-a")
    resp = await client.post("/v1/chat/completions", json={"messages": a, "max_tokens": 2})
    assert resp.status == 200, await resp.text()
    erased = await client.post("/slots/0?action=erase")  # auto-sessions parks a first
    assert erased.status == 200, await erased.text()
    from strata_serve.hook_types import StrataRequest

    service = client.app[SERVICE]
    key = service.conversation_key(StrataRequest(route="chat", body={"messages": a}))
    assert (Path(service.engine.info.slot_save_path) / f"auto-{key}.bin").is_file(), "a was parked"
    assert service.slots[0].empty
    await answered(client)


@scenario("on_config", "adjust_settings")
async def the_start_is_refused_naming_the_plugin(env: Env, plugin: object) -> None:
    # The one hook whose failure stops the start, on purpose: a plugin refuses its section.
    try:
        get_plugin_manager(env.settings(), entrypoints=False, plugins=[plugin])
    except ConfigError as exc:
        env.refused = exc


@scenario("register_commands")
async def other_commands_still_work(env: Env, plugin: object) -> None:
    import click
    from click.testing import CliRunner

    from strata_serve.plugins import add_plugin_commands

    class Greeter:
        strata_name = "greeter"

        @strata_serve.hookimpl
        def register_commands(self, cli):
            @cli.command()
            def greet():
                click.echo("hello from a plugin")

    @click.group()
    def cli() -> None:
        """A command line like strata-serve's."""

    add_plugin_commands(cli, get_plugin_manager(env.settings(), entrypoints=False, plugins=[Greeter(), plugin]))
    result = CliRunner().invoke(cli, ["greet"])
    assert result.exit_code == 0 and "hello from a plugin" in result.output, result.output


@scenario("may_go_ahead")
async def a_request_behind_an_answer_is_asked_about(env: Env, plugin: object) -> None:
    import asyncio

    from strata_serve.testing import until

    client = await env.client(plugin)
    engine = client.app[SERVICE].engine
    plain, go, reached = engine.request, asyncio.Event(), []

    async def first_held(method: str, path: str, json: Any = None, **kwargs: Any) -> Any:
        if path == "/v1/chat/completions":
            reached.append(path)
            if len(reached) == 1:
                await go.wait()
        return await plain(method, path, json, **kwargs)

    engine.request = first_held
    first = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("held")))
    await until(lambda: len(reached) == 1, what="the first request at the engine")
    second = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("behind it")))
    await until(lambda: bool(plugin.calls), what="the plugin asked")  # type: ignore[attr-defined]
    go.set()
    assert [(await first).status, (await second).status] == [200, 200]
