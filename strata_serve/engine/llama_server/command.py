"""llama-server's command line, and what its flags say about how it keeps slots."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import Any

from strata_serve.config import ConfigError, EngineSettings
from strata_serve.engine.base import StateLayout

#: ``--cors-origins`` for an engine we start: a value no page's origin can equal (an origin
#: has a scheme), so no browser page may read the engine's answers.
CORS_SHUT = "none"


def free_port(host: str, avoid: frozenset[int] = frozenset()) -> int:
    """A port free on ``host`` now, none of ``avoid``.

    ``avoid`` holds a port that is free now and taken soon: the server's own, which it binds
    only once its engine is up. Offered it, the engine would take it first, and the server
    could not listen. Each port offered stays bound until one is chosen, so the system
    offers another each time.
    """
    with contextlib.ExitStack() as held:
        for _ in range(len(avoid) + 1):
            sock = held.enter_context(socket.socket())
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in avoid:
                return port
    raise OSError(f"no free port on {host} but {sorted(avoid)}")


def build_command(settings: EngineSettings, binary: Path, port: int) -> list[str]:
    """The llama-server command line for these settings (``engine.extra_args`` last, so they win)."""
    if settings.model is None:
        raise ConfigError("engine.model: a GGUF model path is needed to start the engine (--model)")
    cmd = [
        str(binary),
        "-m", str(settings.model),
        "--host", settings.host,
        "--port", str(port),
    ]
    if settings.side_lane:
        cmd += side_lane_flags(settings)
    else:
        cmd += ["-np", str(settings.parallel), "-c", str(settings.ctx_size)]
    if settings.slot_save_path is not None:
        cmd += ["--slot-save-path", str(settings.slot_save_path)]
    if settings.cache_ram_mib is not None:
        cmd += ["--cache-ram", str(settings.cache_ram_mib)]
    if settings.mmproj is not None:
        cmd += ["--mmproj", str(settings.mmproj)]
    # The key goes in the environment (see LlamaServer._engine_env), never on the command
    # line, which any local user can read in /proc.
    cmd += ["--cors-origins", CORS_SHUT]
    if settings.verbosity is not None:
        # Before extra_args: a -lv there comes later and wins.
        cmd += ["--log-verbosity", str(settings.verbosity)]
    return cmd + list(settings.extra_args)


def side_lane_flags(settings: EngineSettings) -> list[str]:
    """The main slot and the side slot over one KV pool (``engine.side_slot_tokens``).

    ``--kv-unified``: one pool of ``ctx_size + side_slot_tokens`` tokens for both slots.
    ``--kv-unified-per-slot``: each slot holds at most ``ctx_size``, so a conversation
    meets the context limit of the one-slot engine, no more. ``--no-cache-idle-slots``:
    with one pool and the RAM cache on, the engine would otherwise move the idle main slot
    into the RAM cache and clear it whenever the side slot starts a task. strata-serve
    bounds what a side request may add (its ``max_tokens``), so the pool never fills and
    the engine never purges the idle main slot.
    """
    return ["-np", "2", "-c", str(settings.ctx_size + settings.side_slot_tokens), "--kv-unified",
            "--kv-unified-per-slot", str(settings.ctx_size), "--no-cache-idle-slots"]


def clears_idle_slots(settings: EngineSettings) -> bool:
    """Whether llama-server started with these settings empties idle slots on its own.

    With one KV buffer shared by the slots (``--kv-unified``) and its RAM cache on, it
    moves every idle slot into the RAM cache when a task starts (``--cache-idle-slots``,
    on by default). Without ``--kv-unified`` (what an explicit ``-np`` gives) it only
    copies them there, and the slots keep what they hold.
    """
    args = [arg.split("=", 1)[0] for arg in settings.extra_args]
    last = {flag: n for n, flag in enumerate(args)}

    def on(yes: tuple[str, ...], no: tuple[str, ...], default: bool) -> bool:
        said_yes = max((last[f] for f in yes if f in last), default=-1)
        said_no = max((last[f] for f in no if f in last), default=-1)
        return default if said_yes == said_no else said_yes > said_no

    ram = settings.cache_ram_mib != 0 and not any(
        flag in ("-cram", "--cache-ram") and value.strip() == "0"
        for flag, value in zip(settings.extra_args, settings.extra_args[1:]))
    if settings.side_lane:
        return on(("--cache-idle-slots",), ("--no-cache-idle-slots",), False) and ram
    return (settings.parallel > 1 and ram and on(("-kvu", "--kv-unified"), ("-no-kvu", "--no-kv-unified"), False)
            and on(("--cache-idle-slots",), ("--no-cache-idle-slots",), True))


#: llama-server's flags (and environment variables) that shape a slot's saved state:
#: StateLayout field -> (its flag names, its variable).
_LAYOUT_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "cache_type_k": (("-ctk", "--cache-type-k"), "LLAMA_ARG_CACHE_TYPE_K"),
    "cache_type_v": (("-ctv", "--cache-type-v"), "LLAMA_ARG_CACHE_TYPE_V"),
    "flash_attn": (("-fa", "--flash-attn"), "LLAMA_ARG_FLASH_ATTN"),
    "n_gpu_layers": (("-ngl", "--gpu-layers", "--n-gpu-layers"), "LLAMA_ARG_N_GPU_LAYERS"),
}
_FLASH_ATTN = {"on": "on", "1": "on", "true": "on", "enabled": "on",
               "off": "off", "0": "off", "false": "off", "disabled": "off", "auto": "auto"}


def state_layout(args: list[str], env: dict[str, str]) -> StateLayout:
    """The state layout of an engine started with ``args`` in ``env``.

    As llama-server reads them: a variable is the default, a flag overrides it, the
    last flag wins. ``-fa`` without a value (older builds) means on.
    """
    found: dict[str, Any] = {}
    for field, (_flags, variable) in _LAYOUT_FLAGS.items():
        if env.get(variable):
            found[field] = env[variable]
    swa_full = env.get("LLAMA_ARG_SWA_FULL", "").lower() in ("1", "true", "on", "enabled")
    for index, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name == "--swa-full":
            swa_full = True
        for field, (flags, _variable) in _LAYOUT_FLAGS.items():
            if name not in flags:
                continue
            following = args[index + 1] if index + 1 < len(args) else None
            if inline:
                found[field] = inline
            elif field == "flash_attn" and (following is None or following.lower() not in _FLASH_ATTN):
                found[field] = "on"
            elif following is not None:
                found[field] = following
    if "flash_attn" in found:
        found["flash_attn"] = _FLASH_ATTN.get(str(found["flash_attn"]).lower(), str(found["flash_attn"]))
    for field in ("cache_type_k", "cache_type_v"):
        if field in found:
            found[field] = str(found[field]).lower()
    return StateLayout(swa_full=swa_full, **found)
