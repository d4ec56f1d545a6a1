"""A multimodal engine (--mmproj) on the real llama-server, with a tiny random-weight projector.

No projector can be downloaded here, so one is written: a CLIP vision tower of one
block feeding an MLP projector into the demo model's embedding width. Its output
is as meaningless as the demo model's; it exists so llama-server loads a real
multimodal setup, images included, and slot files can be tried against it.
"""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest

import strata_auto_sessions
import strata_quirks_llama_cpp
from strata_serve.api import SERVICE
from strata_serve.demo_model import SIZES
from strata_serve.testing import ask

MIN_TOKENS = 100


def write_tiny_mmproj(path: Path, text_embd: int, *, n_embd: int = 32, image: int = 32, patch: int = 8) -> Path:
    """A CLIP projector (``clip.projector_type`` "mlp") with random float32 weights."""
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type("mlp")
    writer.add_vision_projection_dim(text_embd)
    writer.add_vision_image_size(image)
    writer.add_vision_patch_size(patch)
    writer.add_vision_embedding_length(n_embd)
    writer.add_vision_feed_forward_length(2 * n_embd)
    writer.add_vision_block_count(1)
    writer.add_vision_head_count(2)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_vision_use_gelu(True)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("v.patch_embd.weight", n_embd, 3, patch, patch)
    tensor("v.position_embd.weight", (image // patch) ** 2 + 1, n_embd)
    tensor("v.class_embd", n_embd)
    for norm in ("v.pre_ln", "v.blk.0.ln1", "v.blk.0.ln2"):
        tensor(f"{norm}.weight", n_embd)
        tensor(f"{norm}.bias", n_embd)
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensor(f"v.blk.0.{name}.weight", n_embd, n_embd)
        tensor(f"v.blk.0.{name}.bias", n_embd)
    tensor("v.blk.0.ffn_up.weight", 2 * n_embd, n_embd)
    tensor("v.blk.0.ffn_up.bias", 2 * n_embd)
    tensor("v.blk.0.ffn_down.weight", n_embd, 2 * n_embd)
    tensor("v.blk.0.ffn_down.bias", n_embd)
    tensor("mm.0.weight", text_embd, n_embd)
    tensor("mm.0.bias", text_embd)
    tensor("mm.2.weight", text_embd, text_embd)
    tensor("mm.2.bias", text_embd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def png_data_url(width: int = 32, height: int = 32, rgb: tuple[int, int, int] = (200, 30, 30)) -> str:
    """A plain-colour PNG as a data URL (no imaging library needed)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture
def tiny_mmproj(tmp_path):
    return write_tiny_mmproj(tmp_path / "mmproj.gguf", SIZES["tiny"].n_embd)


async def test_this_build_parks_a_multimodal_conversation_image_included(
    strata_client_factory, strata_settings_factory, tiny_mmproj
):
    # -t 1: the vision tower's threads and the model's would otherwise fight over 2 cores.
    settings = strata_settings_factory(engine={"mmproj": str(tiny_mmproj), "extra_args": ["-t", "1"]},
                                       plugins={"auto_sessions": {"min_tokens": MIN_TOKENS}})
    client = await strata_client_factory(strata_auto_sessions, strata_quirks_llama_cpp, settings=settings)
    service = client.app[SERVICE]
    assert service.engine.info.multimodal
    text = "Look at this picture: " + " ".join(f"pixel{n} red square" for n in range(30))
    with_image = [{"role": "user", "content": [{"type": "text", "text": text},
                                              {"type": "image_url", "image_url": {"url": png_data_url()}}]}]
    other = [{"role": "user", "content": "Another conversation: " + " ".join(f"w{n} sea" for n in range(40))}]
    await ask(client, with_image)
    await ask(client, other)  # the image conversation is saved
    again = await ask(client, with_image)  # ...and restored
    parking = service.state["auto_sessions"]
    assert parking.stats.saves >= 1 and parking.stats.restores == 1 and parking.stats.save_failures == 0
    assert parking.mode.parks, "nothing refused, nothing given up"
    timings = again["timings"]
    assert timings["cache_n"] >= timings["cache_n"] + timings["prompt_n"] - 2, "the restored state is reused"


@pytest.mark.parametrize("fetch", [False, True])
async def test_an_image_named_by_url_is_fetched_only_when_allowed(
    strata_client_factory, strata_settings_factory, tiny_mmproj, aiohttp_server, fetch
):
    """The engine downloads an image named by an http URL itself, from its own machine,
    whatever address it names: off by default, so a client cannot make the engine reach
    what the client cannot. Inline images are answered either way."""
    from aiohttp import web

    fetched = []

    async def image(request):
        fetched.append(request.path)
        png = base64.b64decode(png_data_url().split(",", 1)[1])
        return web.Response(body=png, content_type="image/png")

    app = web.Application()
    app.router.add_get("/inside.png", image)
    inside = await aiohttp_server(app)  # a service only this machine reaches
    settings = strata_settings_factory(engine={"mmproj": str(tiny_mmproj), "extra_args": ["-t", "1"]},
                                       server={"fetch_media_urls": fetch})
    client = await strata_client_factory(settings=settings)
    assert "vision" in client.app[SERVICE].engine.info.modalities

    def asking(url):
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 2, "temperature": 0}

    resp = await client.post("/v1/chat/completions", json=asking(str(inside.make_url("/inside.png"))))
    answer = await resp.json()
    if fetch:
        assert resp.status == 200, answer
        assert fetched == ["/inside.png"]
    else:
        assert resp.status == 400, answer
        assert answer["error"]["code"] == "media_url_refused"
        assert "server.fetch_media_urls" in answer["error"]["message"]
        assert fetched == [], "the engine never asked for it"
    inline = await client.post("/v1/chat/completions", json=asking(png_data_url()))
    assert inline.status == 200, await inline.text()
