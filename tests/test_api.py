"""The HTTP API: OpenAI SDK, streaming, errors in the OpenAI shape.

What strata-serve refuses or answers itself (bad bodies, keys, origins, bounds, slot file
names) runs on the in-memory engine (``client``): with the check gone, the double answers
200 where the test wants a refusal, so each still fails. What the engine answers (the SDK's
round trips, its timings, its own refusals, the files it writes, the routes the double does
not serve) runs on the real one (``engine_client``).
"""

import asyncio
import io
import json
import logging
from pathlib import Path

import openai
import pytest

from strata_serve.api import SERVICE
from strata_serve.testing import assert_openai_error, chat_body


@pytest.fixture
async def client(strata_memory_client_factory, recorder):
    """A server on the in-memory engine: for what strata-serve decides before any engine."""
    return await strata_memory_client_factory(recorder)


@pytest.fixture
async def engine_client(strata_client_factory, recorder):
    """A server on the real engine: for what the engine answers."""
    return await strata_client_factory(recorder)


@pytest.fixture
async def sdk(engine_client):
    """The official OpenAI SDK pointed at the test server."""
    async with openai.AsyncOpenAI(
        base_url=str(engine_client.make_url("/v1")), api_key="unused", max_retries=0
    ) as sdk_client:
        yield sdk_client


async def test_chat_completion_through_the_openai_sdk(sdk, recorder):
    reply = await sdk.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].message.content
    timings = reply.model_extra["timings"]  # passed through from the engine
    assert timings["prompt_n"] + timings["cache_n"] > 5
    assert recorder.outcomes[-1].status == "ok"
    assert recorder.outcomes[-1].timings.generated == timings["predicted_n"]
    assert recorder.outcomes[-1].timings.raw == timings, "the engine's own numbers, kept as sent"


async def test_streaming_through_the_openai_sdk_matches_the_plain_answer(sdk, recorder):
    plain = await sdk.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Stream me"}], max_tokens=12, temperature=0
    )
    stream = await sdk.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Stream me"}], max_tokens=12, temperature=0,
        stream=True,
    )
    pieces, finish = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == plain.choices[0].message.content
    assert finish in {"length", "stop"}
    streamed = recorder.outcomes[-1]
    assert streamed.status == "ok"
    assert streamed.timings is not None and streamed.timings.reused > 0  # same prompt, reused


async def test_completions_models_and_health(engine_client):
    resp = await engine_client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 4, "temperature": 0})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert isinstance(body["choices"][0]["text"], str)
    assert "timings" in body

    models = await (await engine_client.get("/v1/models")).json()
    assert models["data"] and models["data"][0]["id"]

    health = await engine_client.get("/health")
    assert health.status == 200
    assert (await health.json())["status"] == "ok"


async def test_one_model_is_retrieved_by_its_id_through_the_openai_sdk(sdk, engine_client, recorder):
    listed = await sdk.models.list()
    model_id = listed.data[0].id
    model = await sdk.models.retrieve(model_id)
    assert model.id == model_id and model.object == "model"
    # The very entry of the list, but for ``created``: llama-server stamps it anew at each
    # call (the time of the answer), so two calls a second apart differ there.
    entry, retrieved = listed.data[0].model_dump(), model.model_dump()
    assert isinstance(retrieved.pop("created"), int) and isinstance(entry.pop("created"), int)
    assert retrieved == entry, "the very entry of the list"
    assert "/" in model_id, "the engine names its model by the file's path"
    # A client that does not quote the id's slashes (the SDK sends them as %2F) reaches it too.
    raw = await engine_client.get(f"/v1/models/{model_id}")
    assert raw.status == 200 and (await raw.json())["id"] == model_id

    with pytest.raises(openai.NotFoundError) as refused:
        await sdk.models.retrieve("no-such-model")
    assert refused.value.body["code"] == "model_not_found"
    assert "no-such-model" in refused.value.body["message"]
    assert recorder.keys == [], "asked outside the FIFO: no plugin saw a request"


async def test_default_conversation_key_is_sha1_of_first_user_message(client, recorder):
    import hashlib

    body = chat_body("Key me")
    body["messages"].insert(0, {"role": "system", "content": "be terse"})
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    expected = hashlib.sha1(b"Key me").hexdigest()[:16]
    assert recorder.keys == [expected]

    no_user = {"messages": [{"role": "system", "content": "only a system prompt"}], "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=no_user)).status == 200
    assert recorder.keys[-1] is None


@pytest.mark.parametrize(
    "raw, param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"", None),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"max_tokens": 3}).encode(), "messages"),
        (json.dumps({"messages": "hi"}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "messages.0.role"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "messages.0.content.str"),
        (json.dumps({**chat_body(), "stream": "yes"}).encode(), "stream"),
        (json.dumps({**chat_body(), "max_tokens": -1}).encode(), "max_tokens"),
        # OpenAI refuses 0; the engine would write a token all the same.
        (json.dumps({**chat_body(), "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({**chat_body(), "max_completion_tokens": 0}).encode(), "max_completion_tokens"),
        (json.dumps({**chat_body(), "temperature": "hot"}).encode(), "temperature"),
    ],
)
async def test_bad_chat_bodies_get_400_in_openai_shape(client, recorder, raw, param):
    resp = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    if param is not None:
        assert body["error"]["param"] == param
    assert recorder.outcomes == [] and recorder.keys == [], "a bad request must never reach the engine"


@pytest.mark.parametrize("value", ["", []])
async def test_an_empty_responses_input_gets_400_as_empty_messages_do(engine_client, recorder, value):
    # Taken, it ran: the engine wrote from nothing until its limit (minutes on a long context).
    resp = await engine_client.post("/v1/responses", json={"input": value, "max_output_tokens": 2})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["param"].startswith("input"), body
    assert recorder.outcomes == [] and recorder.keys == [], "a bad request must never reach the engine"
    resp = await engine_client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
    assert resp.status == 200, await resp.text()


async def test_no_room_to_answer_is_refused_where_openai_refuses_it(engine_client, recorder):
    # The engine writes a token for a limit of 0 on every route.
    resp = await engine_client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 0})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["param"] == "max_output_tokens"
    assert recorder.outcomes == [] and recorder.keys == [], "a bad request must never reach the engine"
    # OpenAI's completions take 0 (with echo, to score a prompt): so does strata-serve.
    resp = await engine_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("head", [
    "X-Session-Id: a\x01b\r\n",  # a control character in a header's value
    "X-Filler: " + "x" * 9000 + "\r\n",  # a header past aiohttp's 8 KB
    "Transfer-Encoding: chunked\r\n",  # with Content-Length: a request smuggler's pair
], ids=["control character", "header past 8 KB", "length and chunked"])
async def test_bytes_that_are_not_http_get_400_in_openai_shape(client, recorder, head):
    # aiohttp refuses them itself, before any route or middleware: in plain text, until
    # its connection handler was given the shape.
    host, port = client.server.host, client.server.port
    reader, writer = await asyncio.open_connection(host, port)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"{head}Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body)
    await writer.drain()
    try:
        raw = await asyncio.wait_for(reader.read(), timeout=10)  # the connection is closed after it
    finally:
        writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    headers, _, payload = rest.partition(b"\r\n\r\n")
    assert status_line.split()[1:2] == [b"400"], raw[:300]
    assert b"application/json" in headers.lower(), headers
    answer = json.loads(payload)
    assert_openai_error(answer, 400, 400)
    assert answer["error"]["code"] == "malformed_http" and answer["error"]["message"].startswith(
        "malformed HTTP request: "), answer
    assert "\n" not in answer["error"]["message"] and len(answer["error"]["message"]) < 400, answer
    assert recorder.keys == [], "never reached the line"


async def test_bad_completion_body(client):
    resp = await client.post("/v1/completions", json={"prompt": {"x": 1}})
    assert_openai_error(await resp.json(), 400, resp.status)


async def test_unknown_route_wrong_method_and_oversize_body(strata_memory_client_factory, strata_settings_factory):
    client = await strata_memory_client_factory(settings=strata_settings_factory(server={"max_body_mib": 0.01}))
    resp = await client.get("/v1/nothing-here")
    assert_openai_error(await resp.json(), 404, resp.status)

    resp = await client.get("/v1/chat/completions")
    assert_openai_error(await resp.json(), 405, resp.status)
    assert "POST" in resp.headers["Allow"]

    big = chat_body("x" * 20_000)
    resp = await client.post("/v1/chat/completions", json=big)
    assert_openai_error(await resp.json(), 413, resp.status)


async def test_engine_errors_pass_through_in_openai_shape(engine_client):
    # Far longer than the context: the engine refuses it, we relay its 400.
    resp = await engine_client.post("/v1/chat/completions", json=chat_body("word " * 5000))
    assert 400 <= resp.status < 500
    assert_openai_error(await resp.json())


async def test_api_key_guards_everything_but_health(strata_memory_client_factory, strata_settings_factory):
    settings = strata_settings_factory(server={"api_key": "s3cret"})
    client = await strata_memory_client_factory(settings=settings)
    assert (await client.get("/health")).status == 200
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/slots"),
                         ("POST", "/slots/0?action=erase"), ("GET", "/no-such-route")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            resp = await client.request(method, path, headers=headers, json=chat_body())
            assert_openai_error(await resp.json(), 401, resp.status)
    ok = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="s3cret", max_retries=0) as sdk:
        reply = await sdk.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert reply.choices


async def test_api_keys_are_compared_in_constant_time(strata_memory_client_factory, strata_settings_factory,
                                                      monkeypatch):
    import hmac

    compared = []
    real = hmac.compare_digest

    def spy(given, expected):
        compared.append(expected)
        return real(given, expected)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    settings = strata_settings_factory(server={"api_keys": {"a": "key-a", "b": "key-b"}, "api_key": "key-c"})
    client = await strata_memory_client_factory(settings=settings)
    resp = await client.get("/v1/models", headers={"Authorization": "Bearer key-a"})
    assert resp.status == 200
    # Every configured key is compared, whichever matches: the time does not tell which.
    assert sorted(compared) == [b"key-a", b"key-b", b"key-c"]


async def raw_exchange(client, head: bytes, body: bytes = b"", host: str | None = None
                       ) -> tuple[int, dict[str, str], bytes]:
    """Send bytes exactly as given (no client library cleaning them up) and read the answer."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        host = host or f"{client.host}:{client.port}"
        writer.write(head.rstrip(b"\r\n") + b"\r\nHost: " + host.encode()
                     + b"\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    assert answer, "the server dropped the connection without answering"
    status_line, _, rest = answer.partition(b"\r\n")
    header_block, _, payload = rest.partition(b"\r\n\r\n")
    headers = dict(line.decode("latin-1").split(": ", 1) for line in header_block.split(b"\r\n") if b": " in line)
    return int(status_line.split(b" ", 2)[1]), headers, payload


@pytest.mark.parametrize("authorization, accepted", [
    (b"Bearer \xff", False),  # not UTF-8
    (b"Bearer \xe8\xaa\x9e", False),  # UTF-8, not ASCII
    (b"Bearer s3cret\xff", False),
    (b"Bearer " + b"s3cret" * 1000, False),  # huge, under the header limit
    (b"Basic s3cret", False),
    (b"Bearer", False),
    (b"Bearer\ts3cret", False),
    (b"Bearer s3cret extra", False),
    (b"s3cret", False),
    (b"bearer s3cret", True),  # the scheme is case-insensitive
    (b"Bearer   s3cret", True),
])
async def test_malformed_authorization_headers_get_401_in_the_shape(
    strata_memory_client_factory, strata_settings_factory, authorization, accepted
):
    client = await strata_memory_client_factory(settings=strata_settings_factory(server={"api_key": "s3cret"}))
    status, _, payload = await raw_exchange(client, b"GET /v1/models HTTP/1.1\r\nAuthorization: " + authorization)
    if accepted:
        assert status == 200, payload
    else:
        assert_openai_error(json.loads(payload), 401, status)


NESTED_CHAT = '{"messages": [{"role": "user", "content": "nested"}], "max_tokens": 2, "metadata": %s}'


@pytest.mark.parametrize("raw", [
    b"[" * 100_000,
    b'{"a": ' * 100_000,
    (NESTED_CHAT % ('{"a": ' * 150 + "1" + "}" * 150)).encode(),  # parses, yet deeper than allowed
    (NESTED_CHAT % ("[" * 5000 + "]" * 5000)).encode(),
    # the same depth with an escape in it (walked whole), and under many shallow objects
    (NESTED_CHAT % ('{"\\u00e9": ' * 150 + "1" + "}" * 150)).encode(),
    (NESTED_CHAT % ('{"wide": [' + "{}, " * 200 + '{"a": ' * 101 + "1" + "}" * 101 + "]}")).encode(),
])
async def test_deeply_nested_bodies_get_400(client, recorder, raw):
    resp = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["code"] == "too_deeply_nested"
    assert recorder.keys == []


def _refusal(check, body) -> str | None:
    from strata_serve.api.errors import APIError

    try:
        check(body)
    except APIError as exc:
        return exc.code
    return None


def test_the_walk_for_depth_alone_refuses_what_the_whole_walk_refuses():
    # A body whose bytes rule out surrogates is walked for its depth alone: at each depth
    # around the limit, it refuses what the walk through every value refuses, and only that.
    from strata_serve.api.bodies import MAX_JSON_DEPTH, _check_depth, check_json_value

    refused = set()
    for depth in range(MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH + 3):
        deep: object = 1
        for _ in range(depth - 1):  # the body itself is the first level
            deep = {"a": deep} if depth % 2 else [deep]
        body = {"wide": [{"k": [1, "x"]} for _ in range(150)], "deep": deep}
        assert _refusal(_check_depth, body) == _refusal(check_json_value, body), depth
        if _refusal(_check_depth, body) is not None:
            refused.add(depth)
    assert refused == {MAX_JSON_DEPTH + 1, MAX_JSON_DEPTH + 2}


@pytest.mark.parametrize("metadata", [
    '{"a": ' * 90 + "1" + "}" * 90,
    # more arrays and objects than the limit, none nested deeper: walked for depth, answered
    '{"wide": [' + "{}, " * 200 + '{"a": ' * 90 + "1" + "}" * 90 + "]}",
    '{"wide": [' + '{"\\u00e9": [1]}, ' * 200 + '{"a": ' * 90 + "1" + "}" * 90 + "]}",
])
async def test_nesting_within_the_limit_is_answered(client, metadata):
    raw = (NESTED_CHAT % metadata).encode()
    resp = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()


def chat_with(*messages, **extra) -> bytes:
    return json.dumps({"messages": list(messages), "max_tokens": 1, **extra}).encode()


USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize("raw, param", [
    (chat_with({"role": "user", "content": [{"type": "text"}]}), "messages.0.content.str"),
    (chat_with({"role": "user", "content": [{"type": "text", "text": 5}]}), "messages.0.content.str"),
    (chat_with({"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}), "messages.0.content.str"),
    (chat_with({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": 1}}]}),
     "messages.0.content.str"),
    (chat_with(USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, USER),
     "messages.1.tool_calls.0.type"),
    (chat_with(USER, {"role": "assistant", "content": "a", "reasoning_content": 5}, USER),
     "messages.1.reasoning_content"),
    (chat_with(USER, tools=[{"type": "function"}]), "tools.0.function"),
])
async def test_malformed_messages_and_tools_get_400_not_the_engines_500(client, recorder, raw, param):
    # The engine answers each of these with a 500 ("Failed to parse messages", ...),
    # which used to reach the client as a 502 after a trip through the queue.
    resp = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["param"] == param
    assert recorder.keys == []


async def test_well_formed_parts_tool_calls_and_tools_are_answered(engine_client):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    raw = chat_with({"role": "user", "content": [{"type": "text", "text": "x"}]},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "42", "tool_call_id": "c1"},
                    tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    resp = await engine_client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_cannot_be_decompressed_gets_400(client, encoding):
    resp = await client.post("/v1/chat/completions", data=b"not compressed at all",
                             headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["code"] == "unreadable_body"
    # aiohttp's reason, on one line and without its "400, message:" prefix.
    message = body["error"]["message"]
    assert "\n" not in message and "400, message" not in message and "decode" in message.lower(), message


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "top_k": NaN}', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "extra": [Infinity]}', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "extra": -1e999}', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999999999999}', "max_tokens"),
])
async def test_numbers_json_or_the_engine_cannot_hold_get_400_from_us(client, recorder, raw, param):
    resp = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert isinstance(body["error"]["code"], str), "refused here, not relayed from the engine"
    assert body["error"]["param"] == param
    assert recorder.keys == []


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfffb"}]}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "user": "\\udc80"}',
    b'{"messages": [{"role": "user", "content": "x"}], "metadata": {"\\ud83d": 1}}',
    # the escape's hex digits in capitals, and a surrogate's own UTF-8 bytes (no escape)
    b'{"messages": [{"role": "user", "content": "\\uDBFF"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "a\xed\xb2\x80"}], "max_tokens": 2}',
    # in UTF-16 (JSON's encodings are told by the first bytes)
    '{"messages": [{"role": "user", "content": "x"}], "user": "\\udc80"}'.encode("utf-16-le"),
])
async def test_lone_surrogates_are_refused_before_any_plugin_sees_them(client, recorder, raw, caplog):
    resp = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["code"] == "invalid_unicode"
    assert recorder.keys == [], "never keyed (the keying plugins would fail to hash it), never sent"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("action", ["save", "restore"])
@pytest.mark.parametrize("name", ["語" * 200, "é" * 128, "a\x01.bin", "\x7f"])
async def test_slot_file_names_no_file_system_takes_get_400(client, action, name):
    resp = await client.post(f"/slots/0?action={action}", json={"filename": name})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["param"] == "filename"


async def test_the_longest_multibyte_name_a_file_system_takes_is_saved_and_restored(engine_client):
    await engine_client.post("/v1/chat/completions", json=chat_body("fill the slot"))
    name = "語" * 83 + ".bin"  # 253 bytes
    saved = await engine_client.post("/slots/0?action=save", json={"filename": name})
    assert saved.status == 200, await saved.text()
    restored = await engine_client.post("/slots/0?action=restore", json={"filename": name})
    assert restored.status == 200, await restored.text()


async def test_a_body_that_is_not_json_typed_gets_415_and_does_nothing(client, recorder):
    slot_dir = client.app[SERVICE].engine.info.slot_save_path
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "application/jsonx", None):
        headers = {"Content-Type": content_type} if content_type else {}
        for path, body in [("/v1/chat/completions", chat_body()), ("/slots/0?action=save", {"filename": "x.bin"})]:
            data = json.dumps(body).encode()
            if content_type is None:
                status, _, payload = await raw_exchange(client, f"POST {path} HTTP/1.1".encode(), data)
                answer = json.loads(payload)
            else:
                resp = await client.post(path, data=data, headers=headers)
                status, answer = resp.status, await resp.json()
            assert_openai_error(answer, 415, status)
    assert recorder.keys == [], "nothing reached the engine"
    assert not (Path(slot_dir) / "x.bin").exists()
    # JSON with a charset parameter is JSON; an action without a body needs no type.
    ok = await client.post("/v1/chat/completions", data=json.dumps(chat_body()),
                           headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status == 200
    assert (await client.post("/slots/0?action=erase")).status == 200


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/chat/completions", chat_body()),
    ("POST", "/slots/0?action=save", {"filename": "from-a-web-page.bin"}),
    ("GET", "/v1/models", None),
    ("GET", "/slots", None),
])
async def test_a_page_from_another_origin_gets_403(client, recorder, method, path, body):
    resp = await client.request(method, path, json=body, headers={"Origin": "http://evil.example"})
    assert_openai_error(await resp.json(), 403, resp.status)
    assert "Access-Control-Allow-Origin" not in resp.headers
    assert recorder.keys == []
    assert not (Path(client.app[SERVICE].engine.info.slot_save_path) / "from-a-web-page.bin").exists()


async def test_a_page_on_a_rebound_name_is_refused(client):
    # DNS rebinding: evil.example now resolves to 127.0.0.1, so the browser sends Host
    # and Origin that agree, and no Origin at all on a same-origin GET.
    rebound = f"evil.example:{client.port}"
    for origin in (b"Origin: http://" + rebound.encode() + b"\r\n", b""):
        status, _, payload = await raw_exchange(client, b"GET /v1/models HTTP/1.1\r\n" + origin, host=rebound)
        assert_openai_error(json.loads(payload), 403, status)
    status, _, payload = await raw_exchange(
        client, b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\nOrigin: http://"
        + rebound.encode(), json.dumps(chat_body()).encode(), host=rebound)
    assert_openai_error(json.loads(payload), 403, status)
    # The server's own addresses, by IP or as localhost, are same-origin.
    for host in (f"{client.host}:{client.port}", f"localhost:{client.port}"):
        status, _, _ = await raw_exchange(client, b"GET /v1/models HTTP/1.1\r\nOrigin: http://" + host.encode(),
                                          host=host)
        assert status == 200


async def test_names_are_trusted_when_listed_or_when_listening_beyond_loopback(strata_memory_client_factory,
                                                                              strata_settings_factory):
    listed = strata_settings_factory(server={"allowed_origins": ["http://llm.home.example:8080"]})
    client = await strata_memory_client_factory(settings=listed)
    status, _, _ = await raw_exchange(client, b"GET /v1/models HTTP/1.1", host="llm.home.example:8080")
    assert status == 200
    status, _, _ = await raw_exchange(client, b"GET /v1/models HTTP/1.1", host="other.example:8080")
    assert status == 403
    # Listening on every address, the server is meant to be reached by its names.
    client = await strata_memory_client_factory(settings=strata_settings_factory(server={"host": "0.0.0.0"}))
    status, _, _ = await raw_exchange(client, b"GET /v1/models HTTP/1.1", host="gpu-box.lan:8080")
    assert status == 200
    # Served by name, yet a page there is not this server's own: a page on a name rebound
    # to this machine sends an Origin equal to its Host, and it still gets 403.
    for name in ("gpu-box.lan:8080", f"evil.example:{client.port}"):
        status, _, payload = await raw_exchange(
            client, b"GET /v1/models HTTP/1.1\r\nOrigin: http://" + name.encode(), host=name)
        assert_openai_error(json.loads(payload), 403, status)
        assert json.loads(payload)["error"]["code"] == "origin_not_allowed"
    # By its IP address, the same request is same-origin.
    own = f"{client.host}:{client.port}"
    status, _, _ = await raw_exchange(client, b"GET /v1/models HTTP/1.1\r\nOrigin: http://" + own.encode(), host=own)
    assert status == 200


async def test_cors_preflight_answers_allowed_origins_only(strata_memory_client_factory, strata_settings_factory):
    settings = strata_settings_factory(server={"allowed_origins": ["http://ui.example:3000"], "api_key": "k"})
    client = await strata_memory_client_factory(settings=settings)
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    resp = await client.options("/v1/chat/completions", headers={"Origin": "http://ui.example:3000", **preflight})
    assert resp.status == 204
    assert resp.headers.getall("Access-Control-Allow-Origin") == ["http://ui.example:3000"]
    assert resp.headers.getall("Vary") == ["Origin"]
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    assert "content-type" in resp.headers["Access-Control-Allow-Headers"]
    refused = await client.options("/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
    assert_openai_error(await refused.json(), 403, refused.status)
    assert "Access-Control-Allow-Origin" not in refused.headers
    # The real request from the allowed page, streamed: its answer is readable there.
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True),
                             headers={"Origin": "http://ui.example:3000", "Authorization": "Bearer k"})
    assert resp.status == 200
    assert resp.headers["Access-Control-Allow-Origin"] == "http://ui.example:3000"
    await resp.read()
    without_key = await client.post("/v1/chat/completions", json=chat_body(),
                                    headers={"Origin": "http://ui.example:3000"})
    assert_openai_error(await without_key.json(), 401, without_key.status)


async def test_health_is_terse_and_answers_get_and_head_only(strata_memory_client_factory, strata_settings_factory):
    client = await strata_memory_client_factory(settings=strata_settings_factory(server={"api_key": "k"}))
    resp = await client.get("/health")
    assert resp.status == 200 and await resp.json() == {"status": "ok"}
    assert (await client.head("/health")).status == 200
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        resp = await client.request(method, "/health", headers={"Authorization": "Bearer k"})
        assert_openai_error(await resp.json(), 405, resp.status)
        resp = await client.request(method, "/health")
        assert_openai_error(await resp.json(), 401, resp.status)


async def test_slot_directory_and_files_are_private_whatever_the_umask(strata_client_factory, strata_settings_factory,
                                                                       tmp_path):
    import os
    import stat

    import strata_auto_sessions
    from strata_serve.testing import conversation

    slots = tmp_path / "made" / "slots"
    settings = strata_settings_factory(engine={"slot_save_path": str(slots)},
                                       plugins={"auto_sessions": {"min_tokens": 100}})
    previous = os.umask(0)  # the most permissive: every mode below is set, not inherited
    try:
        client = await strata_client_factory(strata_auto_sessions, settings=settings)
        for name in ("a", "b"):  # the switch parks a
            resp = await client.post("/v1/chat/completions", json={"messages": conversation(name), "max_tokens": 2})
            assert resp.status == 200
        await client.post("/slots/0?action=save", json={"filename": "by-hand.bin"})
    finally:
        os.umask(previous)
    files = {str(p.relative_to(slots)): stat.S_IMODE(p.stat().st_mode) for p in slots.rglob("*") if p.is_file()}
    directories = {str(p.relative_to(slots)): stat.S_IMODE(p.stat().st_mode) for p in slots.rglob("*") if p.is_dir()}
    assert stat.S_IMODE(slots.stat().st_mode) == 0o700
    assert {n.rsplit(".", 1)[1] for n in files if "/" not in n} == {"bin", "json"} and len(files) >= 3, files
    assert set(files.values()) == {0o600}, {n: oct(m) for n, m in files.items() if m != 0o600}
    # Parked in blocks: the block store's directories, each as private as the slot directory.
    assert set(directories.values()) <= {0o700}, {n: oct(m) for n, m in directories.items()}


@pytest.mark.parametrize("action", ["save", "restore"])
async def test_a_symlink_loop_in_the_slot_directory_gets_400(client, action):
    slot_dir = Path(client.app[SERVICE].engine.info.slot_save_path)
    slot_dir.mkdir(parents=True, exist_ok=True)  # made by llama-server's start; the double makes none
    (slot_dir / "loop.bin").symlink_to("loop.bin")
    resp = await client.post(f"/slots/0?action={action}", json={"filename": "loop.bin"})
    body = await resp.json()
    assert_openai_error(body, 400, resp.status)
    assert body["error"]["param"] == "filename"


PNG = "data:image/png;base64,iVBORw0KGgo="


#: A medium in each API and route, for a model that takes none: (path, body, error shape).
MEDIA_BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": PNG}}]}],
        "max_tokens": 2}, "openai"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}], "max_tokens": 2}, "openai"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": PNG}]}], "max_output_tokens": 2}, "openai"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "anthropic"),
    # A tool's result carries the image, one level down.
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}]},
     "anthropic"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "anthropic"),
    ("/apply-template", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PNG}}]}]}, "openai"),
]


async def test_media_a_text_only_model_cannot_take_gets_400_before_the_line(engine_client, recorder):
    # The engine answers these with a 500 ("image input is not supported"), which reached
    # the client as a 502 "the engine failed", after evicting the slot's conversation.
    # One engine for every route: each is refused before the line, so none changes it.
    assert engine_client.app[SERVICE].engine.info.modalities == frozenset()
    for path, body, shape in MEDIA_BODIES:
        resp = await engine_client.post(path, json=body)
        answer = await resp.json()
        assert resp.status == 400, (path, answer)
        if shape == "openai":
            assert_openai_error(answer, 400, resp.status)
            assert answer["error"]["code"] == "not_supported", (path, answer)
            message = answer["error"]["message"]
        else:
            assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", (path, answer)
            message = answer["error"]["message"]
        assert "takes no" in message and "engine.mmproj" in message, (path, message)
        assert recorder.keys == [], f"{path}: never queued: no plugin saw it, nothing was evicted"


async def test_more_messages_than_the_context_or_the_limit_get_400_before_validation(
    strata_client_factory, strata_settings_factory, recorder
):
    # The engine renders its chat template in a time that grows faster than the number of
    # messages and cannot stop midway: 400,000 one-word messages kept it busy for hours
    # after the client left. Counted before anything else looks at them.
    settings = strata_settings_factory(server={"max_messages": 50})
    client = await strata_client_factory(recorder, settings=settings)
    n_ctx = client.app[SERVICE].engine.info.n_ctx
    assert n_ctx and n_ctx > 50
    hi = {"role": "user", "content": "hi"}
    for path, body, field in [
        ("/v1/chat/completions", {"messages": [hi] * 51, "max_tokens": 1}, "messages"),
        ("/v1/chat/completions", {"messages": [hi] * (n_ctx + 1), "max_tokens": 1}, "messages"),
        ("/v1/chat/completions", {"messages": [hi] * 400_000, "max_tokens": 1}, "messages"),
        ("/apply-template", {"messages": [hi] * 51}, "messages"),
        ("/v1/responses", {"input": [hi] * 51, "max_output_tokens": 1}, "input"),
    ]:
        resp = await client.post(path, data=io.BytesIO(json.dumps(body).encode()),
                                 headers={"Content-Type": "application/json"})
        answer = await resp.json()
        assert_openai_error(answer, 400, resp.status)
        assert (answer["error"]["code"], answer["error"]["param"]) == ("too_many_messages", field), answer
    resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": [hi] * 51})
    answer = await resp.json()
    assert resp.status == 400 and "server.max_messages (50)" in answer["error"]["message"], answer
    assert recorder.keys == [], "none reached the line"
    # At the limit: answered. Other lists (embeddings' inputs) are not messages.
    assert (await client.post("/v1/chat/completions", json={"messages": [hi] * 50, "max_tokens": 1})).status == 200
    embeddings = await (await client.post("/v1/embeddings", json={"input": ["a"] * 60})).json()
    assert embeddings["error"]["code"] != "too_many_messages"


async def test_request_bodies_together_are_bounded_not_only_each(strata_memory_client_factory, strata_settings_factory):
    # Thirty clients sending large (or compressed) bodies at once took the server past 1.5 GB:
    # each body is held from its first byte to its answer. A body of 1 MiB and one of 0.5 MiB
    # on their way fill a 1.5 MiB budget; a third request is refused at once, before its
    # body is read.
    settings = strata_settings_factory(server={"max_body_mib": 1, "max_bodies_mib": 1.5})
    client = await strata_memory_client_factory(settings=settings)
    host, port = client.server.host, client.server.port
    mib = 1024 * 1024
    slow = []
    for length in (mib, mib // 2):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {length}\r\n\r\n".encode() + b'{"messages": [')
        await writer.drain()
        slow.append((reader, writer))
    body = chat_body("hi", max_tokens=1)

    async def refused() -> bool:
        resp = await client.post("/v1/chat/completions", json=body)
        if resp.status != 503:
            assert resp.status == 200, await resp.text()
            return False
        answer = await resp.json()
        assert_openai_error(answer, 503, resp.status)
        assert answer["error"]["code"] == "bodies_budget" and resp.headers["Retry-After"] == "1"
        return True

    async def until(want_refused: bool, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + 10
        while await refused() != want_refused:
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.05)

    async def gzipped() -> int:
        resp = await client.post("/v1/chat/completions", data=b"\x1f\x8b", headers={
            "Content-Type": "application/json", "Content-Encoding": "gzip"})
        return resp.status

    try:
        await until(True, "the budget never filled")  # the two slow requests reach their handlers
        # The smaller client gives up: its reservation is returned, and a small body fits again.
        slow[1][1].close()
        await slow[1][1].wait_closed()
        await until(False, "the reservation of a client that left was never returned")
        # Room for a 2-byte body but not for the largest one: a compressed body may inflate to
        # that, so it reserves that, and is refused where its Content-Length alone would fit.
        assert await gzipped() == 503, "a compressed body reserves the largest size"
        slow[0][1].close()
        await slow[0][1].wait_closed()
        deadline = asyncio.get_running_loop().time() + 10
        while (status := await gzipped()) == 503:  # the last reservation returned
            assert asyncio.get_running_loop().time() < deadline, "the budget never emptied"
            await asyncio.sleep(0.05)
        assert status == 400, "within the budget, the compressed body is read (and is not gzip)"
    finally:  # a client left open would hold the server's stop for read_timeout_s
        for _, writer in slow:
            writer.close()


async def test_a_media_type_spelled_with_escapes_is_still_checked(engine_client, recorder):
    # Media are looked for only in bodies whose bytes could hold them; a type written with
    # \u escapes has none of the words in its bytes and must be checked all the same.
    raw = ('{"messages": [{"role": "user", "content": [{"type": "\\u0069mage_url", '
           '"\\u0069mage_url": {"url": "iVBORw0KGgo="}}]}], "max_tokens": 2}')
    assert not any(word in raw for word in ("image", "audio", "video"))
    resp = await engine_client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    answer = await resp.json()
    assert_openai_error(answer, 400, resp.status)
    assert answer["error"]["code"] == "not_supported"
    assert recorder.keys == []
