"""``/slots``: the engine's slot API, guarded.

Save, restore and erase go through the service FIFO like any request, so they
never interleave with another conversation. A filename must name a file directly
inside the slot directory once real paths are resolved: the engine checks only the
name's text, and a symlink in the directory could otherwise point anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

from strata_serve.api.errors import APIError
from strata_serve.api.keys import TENANT
from strata_serve.api.openai_routes import read_json, service_errors, service_of
from strata_serve.api.schemas import SlotFile
from strata_serve.engine.base import EngineUnavailable
from strata_serve.exchange import EngineError, Outcome, StrataRequest

routes = web.RouteTableDef()
ACTIONS = ("save", "restore", "erase")


def slot_file(slot_dir: Path, filename: str) -> Path:
    """The real path of ``filename`` in ``slot_dir``.

    :raises APIError: 400 when the name, once resolved, is not directly inside the directory.
    """
    if "\x00" in filename or "/" in filename or "\\" in filename or filename in {".", ".."}:
        raise APIError(400, f"invalid filename {filename!r}: a plain file name is expected",
                       param="filename", code="invalid_filename")
    base = slot_dir.resolve()
    try:
        target = (base / filename).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise APIError(400, f"invalid filename {filename!r}: it cannot be resolved ({exc})",
                       param="filename", code="invalid_filename") from None
    if target.parent != base:
        raise APIError(400, f"invalid filename {filename!r}: it leads outside the slot directory",
                       param="filename", code="invalid_filename")
    return target


@routes.get("/slots")
async def list_slots(request: web.Request) -> web.Response:
    service = service_of(request)
    try:
        await service.engine.wait_ready()
        return web.json_response(await service.engine.slots())
    except EngineUnavailable as exc:
        raise APIError(exc.status, str(exc)) from None
    except EngineError as exc:
        raise APIError(502, str(exc)) from None


@routes.post("/slots/{slot_id}")
async def slot_action(request: web.Request) -> web.Response:
    service = service_of(request)
    if not service.single_slot:
        raise APIError(
            409,
            f"slot actions need a single-slot engine; this one runs {service.settings.engine.parallel} "
            "slots in parallel, so a slot does not belong to one conversation",
            code="parallel_slots",
        )
    if request.match_info["slot_id"] != "0":
        raise APIError(404, "only slot 0 exists on a single-slot engine", code="no_such_slot")
    action = request.query.get("action")
    if action not in ACTIONS:
        raise APIError(400, f"action must be one of {', '.join(ACTIONS)}", param="action")
    body: dict[str, Any] = {"action": action}
    if action != "erase":
        slot_dir = service.engine.info.slot_save_path
        if slot_dir is None:
            raise APIError(409, "no slot directory is configured (engine.slot_save_path, --slot-save-path)",
                           code="no_slot_directory")
        filename = SlotFile.model_validate(await read_json(request, SlotFile)).filename
        path = slot_file(Path(slot_dir), filename)
        if action == "restore" and not path.is_file():
            raise APIError(404, f"no slot file named {filename!r}", param="filename", code="no_such_file")
        body["filename"] = filename

    sreq = StrataRequest(route="slots", body=body, headers=request.headers, tenant=request.get(TENANT))
    result: dict[str, Any] = {}

    async def send(outcome: Outcome) -> None:
        engine = service.engine
        call = {"save": engine.save, "restore": engine.restore}.get(action)
        answer = await (call(body["filename"]) if call else engine.erase())
        result.update(answer)
        outcome.status, outcome.http_status, outcome.error = "ok", 200, None
        outcome.timings = answer.get("timings")

    try:
        with service_errors(service):
            await service.process(sreq, send)
    except EngineError as exc:
        status = exc.status if exc.status and 400 <= exc.status < 500 else 502
        raise APIError(status, f"the engine refused to {action}: {exc.message}", code="engine_refused") from None
    return web.json_response(result)
