"""llama-server's JSON in strata-serve's own types: the one place its field names are read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strata_serve.engine.base import ContextOverflow, EngineInfo, SlotErased, SlotReport, SlotRestored, SlotSaved
from strata_serve.engine.llama_server.binary import packaged_build
from strata_serve.engine.results import Timings, token_count

#: Where llama-server adds its own numbers to an answer and to a stream's events.
NUMBERS_KEY = "timings"


def _ms(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else None


def read_llama_timings(numbers: Any) -> Timings | None:
    """:class:`Timings` from a llama-server ``timings`` object (None unless it has token counts).

    ``cache_n`` reused, ``prompt_n`` read, ``predicted_n`` generated, with ``prompt_ms``
    and ``predicted_ms``.
    """
    if not isinstance(numbers, dict):
        return None
    reused, prefilled = token_count(numbers.get("cache_n")), token_count(numbers.get("prompt_n"))
    if reused is None and prefilled is None:
        return None
    return Timings(reused=reused or 0, prefilled=prefilled or 0, generated=token_count(numbers.get("predicted_n")) or 0,
                   prefill_ms=_ms(numbers.get("prompt_ms")), generate_ms=_ms(numbers.get("predicted_ms")),
                   raw=numbers)


def slot_reports(answer: list[Any]) -> list[SlotReport]:
    """``GET /slots``: one entry a slot, by ``id``; entries without one are left out.

    ``n_prompt_tokens`` is the slot's cached tokens: the last task's prompt and what it
    generated (0 after an erase, the file's count after a restore), as a save would
    write. A slot that never ran a task has no such field, even after a restore.
    """
    reports = []
    for entry in answer:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), int) or isinstance(entry["id"], bool):
            continue
        task, tokens = entry.get("id_task"), entry.get("n_prompt_tokens")
        reports.append(SlotReport(
            id=entry["id"], processing=entry.get("is_processing") is True,
            task=task if isinstance(task, int) and not isinstance(task, bool) else None,
            tokens=token_count(tokens), raw=entry))
    return reports


def slot_saved(answer: dict[str, Any]) -> SlotSaved:
    """``POST /slots/{id}?action=save``: ``n_saved`` tokens, ``n_written`` bytes."""
    return SlotSaved(tokens=token_count(answer.get("n_saved")) or 0,
                     bytes=token_count(answer.get("n_written")) or 0, raw=answer)


def slot_restored(answer: dict[str, Any]) -> SlotRestored:
    """``POST /slots/{id}?action=restore``: ``n_restored`` tokens, ``n_read`` bytes."""
    return SlotRestored(tokens=token_count(answer.get("n_restored")) or 0,
                        bytes=token_count(answer.get("n_read")) or 0, raw=answer)


def slot_erased(answer: dict[str, Any]) -> SlotErased:
    """``POST /slots/{id}?action=erase``: ``n_erased`` tokens."""
    return SlotErased(tokens=token_count(answer.get("n_erased")), raw=answer)


#: llama-server's error type for a prompt longer than a slot's context (HTTP 400, with
#: ``n_prompt_tokens`` and ``n_ctx``); its message says "the request exceeds the available
#: context size, try increasing it" and no more.
EXCEEDS_CONTEXT = "exceed_context_size_error"


def read_overflow(error: dict[str, Any]) -> ContextOverflow | None:
    """An ``exceed_context_size_error``, with its ``n_prompt_tokens`` and ``n_ctx`` when they are counts."""
    if error.get("type") != EXCEEDS_CONTEXT:
        return None
    prompt, context = token_count(error.get("n_prompt_tokens")), token_count(error.get("n_ctx"))
    return ContextOverflow(prompt_tokens=prompt or None, context_tokens=context or None)


def read_props(info: EngineInfo, props: dict[str, Any], binary: Path | None) -> None:
    """What ``GET /props`` says of the engine, into ``info`` (what it does not say is kept)."""
    settings = props.get("default_generation_settings") or {}
    info.n_ctx = settings.get("n_ctx") or props.get("n_ctx") or info.n_ctx
    info.parallel = props.get("total_slots") or info.parallel
    info.build = props.get("build_info") or info.build
    if info.build is None or info.build.startswith("b0-"):
        info.build = packaged_build(binary) or info.build
    info.model_ftype = props.get("model_ftype") or info.model_ftype
    modalities = props.get("modalities")
    if isinstance(modalities, dict):
        info.modalities = frozenset(name for name, on in modalities.items() if on is True)
    if not info.model_path and props.get("model_path"):
        info.model_path = props["model_path"]


def error_message(body: Any) -> str:
    """What an error answer says, in a line."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return str(body)[:500]
