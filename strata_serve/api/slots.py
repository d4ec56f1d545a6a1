"""``/slots``: the engine's slot API, guarded.

Save, restore and erase hold their slot in the service FIFO (``Service.slot_action``),
so they never interleave with another conversation there. A filename must name a file directly
inside the slot directory once real paths are resolved: the engine checks only the
name's text, and a symlink in the directory could otherwise point anywhere.

Every tenant may use it, each in a namespace of its own: a named tenant's
``x.bin`` is ``hand-<tenant>--x.bin`` on disk, the unnamed tenant's (the plain
``server.api_key``, or anyone when no key is set) is ``x.bin``. Names that begin
with ``auto-``, ``tmp-`` or ``hand-`` (in any case) are refused to everyone: they are
auto-sessions' files, plugins' temporaries and the named tenants' namespaces. So
no tenant can name another's file, and no answer tells whether one exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from strata_serve.api.errors import APIError
from strata_serve.api.app_state import TENANT
from strata_serve.api.bodies import read_json
from strata_serve.api.relay import service_errors, service_of
from strata_serve.api.schemas import SlotFile
from strata_serve.engine.base import EngineUnavailable, SlotReport
from strata_serve.hook_types import EngineError
from strata_serve.service import Service
from strata_serve.tenants import TENANT_SEPARATOR

routes = web.RouteTableDef()
SlotActionName = Literal["save", "restore", "erase"]
ACTIONS: tuple[SlotActionName, ...] = ("save", "restore", "erase")
#: Refused as the start of a hand-saved name, whatever its case (see the module's doc).
RESERVED_PREFIXES = ("auto-", "tmp-", "hand-")
HAND_PREFIX = "hand-"
#: Longest file name most file systems take, in bytes.
MAX_NAME_BYTES = 255


def engine_filename(tenant: str | None, filename: str) -> str:
    """The name in the slot directory of the file ``tenant`` calls ``filename``.

    One-to-one, also under case folding between tenants: tenant names have no ``-``
    and differ by more than case, and no unnamed tenant's name begins with ``hand-``.

    :raises APIError: 400 for a reserved name, or one too long once namespaced.
    """
    if filename.casefold().startswith(RESERVED_PREFIXES):
        raise APIError(400, f"invalid filename {filename!r}: names beginning with "
                       f"{', '.join(RESERVED_PREFIXES)} are reserved", param="filename", code="reserved_filename")
    prefix = "" if tenant is None else f"{HAND_PREFIX}{tenant}{TENANT_SEPARATOR}"
    try:
        size = len(filename.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape: no file can have it
        raise APIError(400, "invalid filename: it is not valid Unicode text", param="filename",
                       code="invalid_filename") from None
    if len(prefix) + size > MAX_NAME_BYTES:
        raise APIError(400, f"invalid filename: it is {size} bytes long in UTF-8; at most "
                       f"{MAX_NAME_BYTES - len(prefix)} fit", param="filename", code="invalid_filename")
    return prefix + filename


def slot_file(slot_dir: Path, filename: str, shown: str | None = None) -> Path:
    """The real path of ``filename`` in ``slot_dir``.

    :param shown: the name the client gave, for the messages (default ``filename``).
    :raises APIError: 400 when the name, once resolved, is not directly inside the directory.
    """
    shown = filename if shown is None else shown
    if "\x00" in filename or "/" in filename or "\\" in filename or filename in {".", ".."}:
        raise APIError(400, f"invalid filename {shown!r}: a plain file name is expected",
                       param="filename", code="invalid_filename")
    base = slot_dir.resolve()
    path = base / filename
    try:
        # A symlink must lead somewhere real: strictly, a loop or a dangling link fails here
        # (without strict, Python 3.13 returns a looping path as it is).
        target = path.resolve(strict=path.is_symlink())
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop before Python 3.13
        raise APIError(400, f"invalid filename {shown!r}: it is a link that leads nowhere",
                       param="filename", code="invalid_filename") from None
    if target.parent != base:
        raise APIError(400, f"invalid filename {shown!r}: it leads outside the slot directory",
                       param="filename", code="invalid_filename")
    return target


@routes.get("/slots")
async def list_slots(request: web.Request) -> web.Response:
    service = service_of(request)
    if not service.settings.server.sees_every_tenant(request.get(TENANT)):
        raise APIError(403, "with strict tenant isolation the engine's slots are listed only to the "
                       "plain server.api_key", code="strict_isolation")
    try:
        await service.engine.wait_ready()
        reports = await service.engine.slots()
        return web.json_response(figures_for(service, request.get(TENANT), reports))
    except EngineUnavailable as exc:
        raise APIError(exc.status, str(exc)) from None
    except EngineError as exc:
        raise APIError(502, str(exc)) from None


#: What an engine may say of a slot beyond its figures: the words of its last prompt and
#: answer, and the request's parameters (stop strings, grammars, schemas). llama-server
#: shows them when run with ``LLAMA_SERVER_SLOTS_DEBUG``.
SLOT_CONTENT = ("prompt", "generated", "params")


def figures_for(service: Service, tenant: str | None, reports: list[SlotReport]) -> list[Any]:
    """The engine's own account of its slots as ``tenant`` may see it: with named
    tenants, a slot's content only to the tenant the slot's state belongs to; figures
    to everyone."""
    if not service.settings.server.api_keys:
        return [report.raw for report in reports]  # one user: everything is theirs
    shown = []
    for report in reports:
        entry = report.raw
        if isinstance(entry, dict):
            owner = service.slots[report.id].tenant if 0 <= report.id < len(service.slots) else None
            if owner is None or owner != tenant:
                entry = {k: v for k, v in entry.items() if k not in SLOT_CONTENT}
        shown.append(entry)
    return shown


@routes.post("/slots/{slot_id}")
async def slot_action(request: web.Request) -> web.Response:
    service = service_of(request)
    slots = len(service.slots)
    slot_id = request.match_info["slot_id"]
    if not slot_id.isascii() or not slot_id.isdigit() or int(slot_id) >= slots:
        raise APIError(404, f"no slot {slot_id!r}: the engine runs {slots} slot(s), 0 to {slots - 1}",
                       code="no_such_slot")
    slot = int(slot_id)
    action = next((name for name in ACTIONS if name == request.query.get("action")), None)
    if action is None:
        raise APIError(400, f"action must be one of {', '.join(ACTIONS)}", param="action")
    tenant = request.get(TENANT)
    filename = on_disk = ""
    if action != "erase":
        slot_dir = service.engine.info.slot_save_path
        if slot_dir is None:
            raise APIError(409, "no slot directory is configured (engine.slot_save_path, --slot-save-path)",
                           code="no_slot_directory")
        filename = SlotFile.model_validate(await read_json(request, SlotFile)).filename
        on_disk = engine_filename(tenant, filename)
        path = slot_file(Path(slot_dir), on_disk, shown=filename)
        if action == "restore" and not path.is_file():
            raise APIError(404, f"no slot file named {filename!r}", param="filename", code="no_such_file")

    try:
        with service_errors(service):
            # Through the service, so its record of the slot follows what was done by hand.
            answer = await service.slot_action(slot, action, on_disk or None, tenant=tenant)
            # The engine's own answer, as it gave it.
            result = dict(answer.raw) if isinstance(answer.raw, dict) else {}
    except EngineError as exc:
        status = exc.status if exc.status and 400 <= exc.status < 500 else 502
        message = exc.message.replace(on_disk, filename) if on_disk else exc.message
        raise APIError(status, f"the engine refused to {action}: {message}", code="engine_refused") from None
    if "filename" in result:
        result["filename"] = filename  # the client's name for it, not the one on disk
    return web.json_response(result)
