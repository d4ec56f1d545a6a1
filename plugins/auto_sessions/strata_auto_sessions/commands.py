"""``strata-serve sessions``: the parked conversations of a slot directory, listed,
inspected, removed and pruned, beside a running server or not.

Every command takes the store's lock (an exclusive ``flock`` on the directory), which
the server takes around each commit, prune and restore, so neither sees the other's
work half-done. A conversation removed while a server holds it in its slot, saved or
not yet, is not written back: the server drops its saves of the state it held then and
erases the slot (it records what it holds in the directory, and ``rm`` leaves a
removal marker there). A pruned one is: pruning makes room on disk, and the server
saves the conversation it holds again when it leaves the slot, since its file is gone.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import click

import strata_serve
from strata_serve import ConfigError, load_settings

from strata_auto_sessions.config import GB, NAME, AutoSessionsConfig
from strata_auto_sessions.config import SharedConfig
from strata_auto_sessions.clock import as_of
from strata_auto_sessions.compat import incompatibility
from strata_auto_sessions.digests import digest_matches
from strata_auto_sessions.naming import SESSION_NAME, sibling_of
from strata_auto_sessions.parked_blocks import ParkedBlocks
from strata_auto_sessions.sidecar import Sidecar
from strata_auto_sessions.store import SessionStore


class Sessions:
    """The directory a command works on, and how it judges compatibility."""

    def __init__(self, store: SessionStore, build_range: int, shared: SharedConfig | None = None):
        self.store = store
        self.build_range = build_range
        #: The shared tier the servers use (``plugins.auto_sessions.shared``), or None.
        self.shared = shared

    def rows(self) -> list[dict[str, Any]]:
        """One row per parked conversation (each sibling of a key its own), newest first."""
        engine = self.store.engine_description()
        sidecars = {self.store.bin_path(key, sidecar.sibling): sidecar for key, sidecar in self.store.sessions()}
        now = time.time()
        rows = []
        holdings = self.store.blocks.holdings() if self.store.blocks is not None else {}
        for key, path, size, last_used in self.store.files():
            sidecar = sidecars.get(path)
            if sidecar is None:
                continue
            held = None if path.is_file() else holdings.get((key, sidecar.sibling))
            # A time stamped ahead of the clock (a run with its clock set wrong) is not an age;
            # files() gives 0 for a file whose every time is.
            created, used = as_of(sidecar.created, now), last_used or None
            rows.append({
                "key": key, "sibling": sidecar.sibling, "tenant": tenant_of(key, sidecar), "tokens": sidecar.tokens,
                "bytes": size,
                "age_s": None if created is None else now - created,
                "last_used_s": None if used is None else now - used,
                "compatible": self.compatible(sidecar, engine), "file": str(path),
                "stamped_ahead": created is None or used is None,
                # In blocks: the bytes it alone holds, and those it shares with others of its tenant.
                "blocks": held is not None, "own_bytes": size if held is None else held.own,
                "shared_bytes": 0 if held is None else held.shared,
            })
        for key, path, why in self.store.damaged():
            # In blocks its name stands for a manifest: the bytes of the blocks it names.
            match = SESSION_NAME.fullmatch(path.name)
            size = (path.stat().st_size if path.is_file() or match is None
                    else self.store.size_of(key, sibling_of(match)))
            rows.append({"key": key, "sibling": None, "tenant": None, "tokens": None, "bytes": size,
                         "age_s": None,
                         "last_used_s": None, "compatible": f"no (damaged): its sidecar is refused: {why}",
                         "file": str(path), "damaged": why})
        return rows

    def compatible(self, sidecar: Sidecar, engine: dict[str, Any] | None) -> str:
        if engine is None:
            return "unknown: no server has described its engine here yet"
        refusal = incompatibility(sidecar, engine["fingerprint"], build_range=self.build_range)
        return "yes" if refusal is None else f"no ({refusal.reason}): {refusal.detail}"


def tenant_of(key: str, sidecar: Sidecar) -> str | None:
    """The tenant a conversation belongs to: its sidecar's, or the one its key names."""
    if sidecar.tenant is not None:
        return sidecar.tenant
    return strata_serve.tenant_of(key)


def _sessions(config: Path | None, slot_dir: Path | None) -> Sessions:
    try:
        settings = load_settings(config)
        plugin = settings.plugin_config(NAME, AutoSessionsConfig)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(f"configuration: {exc}") from None
    directory = slot_dir or plugin.slot_dir or settings.engine.slot_save_path
    if directory is None:
        raise click.ClickException("no slot directory: give --slot-dir, or --config with engine.slot_save_path")
    if not Path(directory).is_dir():
        raise click.ClickException(f"{directory} is not a directory")
    return Sessions(SessionStore(Path(directory), ParkedBlocks.existing(Path(directory))), plugin.build_range,
                    plugin.shared)


def _run_shared(found: Sessions, work: Any) -> Any:
    """``work(tier)`` on the shared tier, to its end; a store that fails is a clear error."""
    from strata_auto_sessions.shared import SharedTierError, tier_for

    assert found.shared is not None
    config = found.shared

    async def run() -> Any:
        tier = tier_for(config)
        try:
            return await work(tier)
        finally:
            await tier.close()

    try:
        return asyncio.run(run())
    except (SharedTierError, OSError, TimeoutError) as exc:
        raise click.ClickException(f"the shared tier {config.url}: {exc or type(exc).__name__}") from None


#: The fields of a head and the types ``sessions`` can show (a head written by another
#: version, or by hand, may hold anything).
_HEAD_TYPES: dict[str, tuple[type, ...]] = {
    "generation": (int,), "upload": (str, type(None)), "tokens": (int,), "bytes": (int,), "digest": (str,),
    "created": (int, float), "written": (int, float), "removed": (int, float, type(None)), "writer": (str,),
}


def _head_damage(head: Any) -> str | None:
    """Why a head read from the tier cannot be shown, or None when it can."""
    for name, types in _HEAD_TYPES.items():
        value = getattr(head, name, None)
        if isinstance(value, bool) or not isinstance(value, types) or isinstance(value, float) and value != value:
            return f"its {name} is {value!r}"
    if head.generation < 0 or head.tokens < 0 or head.bytes < 0:
        return "a count below zero"
    return None


class SharedListing:
    """What ``sessions`` read of the shared tier: one row per conversation file it holds a
    head for (held, removed by hand, or damaged), and why it could not read the rest."""

    def __init__(self, rows: list[dict[str, Any]], error: str | None = None):
        self.rows = rows
        #: The tier could not be listed, or stopped answering part way: why.
        self.error = error

    def damaged(self) -> dict[str, str]:
        """Key -> why one of its heads cannot be read (a tombstone cannot be written over it either)."""
        return {row["key"]: row["damaged"] for row in self.rows if row.get("damaged") is not None}

    def live(self) -> dict[str, list[dict[str, Any]]]:
        """Key -> its rows whose conversation the tier still holds (neither removed nor damaged)."""
        keys: dict[str, list[dict[str, Any]]] = {}
        for row in self.rows:
            if row.get("damaged") is None and row["removed_s"] is None and row["tokens"] is not None:
                keys.setdefault(row["key"], []).append(row)
        return keys


def _read_shared(found: Sessions) -> SharedListing:
    """Every head of the shared tier, read one by one: a damaged head (not a head record,
    or a field of the wrong type) is a row saying so; a tier that cannot be listed, or
    stops answering part way, gives the rows read so far and why. Never raises."""
    from strata_auto_sessions.naming import PREFIX, SESSION_NAME, key_of_file, sibling_of
    from strata_auto_sessions.shared import SharedTierError, tier_for

    assert found.shared is not None
    config = found.shared
    timeout = config.timeout_s
    rows: list[dict[str, Any]] = []

    async def look() -> str | None:
        tier = tier_for(config)
        try:
            now = time.time()
            names = await asyncio.wait_for(tier.heads(PREFIX), timeout)
            for name in names:
                match = SESSION_NAME.fullmatch(name)
                if match is None or match["ext"] != "bin":
                    continue  # the start check's probe, or no conversation file
                key = key_of_file(match["key"])
                row: dict[str, Any] = {
                    "shared": True, "key": key, "sibling": sibling_of(match), "tenant": strata_serve.tenant_of(key),
                    "generation": None, "tokens": None, "bytes": None, "saved_s": None, "removed_s": None,
                    "writer": None, "name": name,
                }
                try:
                    current = await asyncio.wait_for(tier.head(name), timeout)
                except TimeoutError:
                    raise  # the tier stopped answering: the rest is not read
                except (SharedTierError, OSError, ValueError) as exc:
                    why = str(exc) or type(exc).__name__
                    rows.append({**row, "damaged": why if name in why else f"head {name}: {why}"})
                    continue
                if current is None:
                    continue  # removed since it was listed
                head = current[0]
                damage = _head_damage(head)
                if damage is not None:
                    rows.append({**row, "damaged": f"head {name} is damaged: {damage}"})
                    continue
                rows.append({
                    **row, "generation": head.generation, "tokens": None if head.tombstone else head.tokens,
                    "bytes": None if head.tombstone else head.bytes, "saved_s": _age(head.written, now),
                    "removed_s": None if head.removed is None else _age(head.removed, now),
                    "writer": head.writer or None,
                })
            return None
        finally:
            try:
                await asyncio.wait_for(tier.close(), timeout)
            except (SharedTierError, OSError, TimeoutError):
                pass

    try:
        error = asyncio.run(look())
    except TimeoutError:
        error = f"it did not answer within {timeout:g} s"
    except (SharedTierError, OSError, ValueError) as exc:
        error = str(exc) or type(exc).__name__
    rows.sort(key=lambda row: (row["saved_s"] is None, row["saved_s"] or 0))
    return SharedListing(rows, error)


def _age(stamp: float, now: float) -> float | None:
    """Seconds since ``stamp`` (another server's clock wrote it); None when it is ahead of this one."""
    taken = as_of(stamp, now)
    return None if taken is None else now - taken


def _remove_shared(found: Sessions, keys: list[str]) -> tuple[list[str], dict[str, str]]:
    """A tombstone over each shared file of ``keys``: the names removed, and the keys whose
    removal failed with why (a damaged head, the tier gone meanwhile)."""
    from strata_auto_sessions.shared import SharedTierError
    from strata_auto_sessions.shared.sweep import remove_by_hand

    assert found.shared is not None
    config = found.shared
    removed: list[str] = []
    failed: dict[str, str] = {}

    async def work(tier: Any) -> None:
        for key in keys:
            try:
                removed.extend(await remove_by_hand(tier, config, [key]))
            except TimeoutError:
                failed[key] = f"the shared tier did not answer within {config.timeout_s:g} s"
            except (SharedTierError, OSError, ValueError) as exc:
                failed[key] = str(exc) or type(exc).__name__

    _run_shared(found, work)
    return removed, failed


def _is_key(key: str) -> bool:
    """Whether ``key`` is one strata-serve makes (one a file can be named after)."""
    from strata_auto_sessions.naming import file_key

    try:
        file_key(key)
    except ValueError:
        return False
    return True


def _size(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 100 else f"{n / 1024**2:.2f} MB"


def _echo_blocks(found: Sessions, as_json: bool) -> None:
    """``ls --blocks``: what the block store holds, and what its sharing saves."""
    blocks = found.store.blocks
    with found.store.lock():
        if blocks is None:
            detail: dict[str, Any] = {"manifests": 0, "blocks": 0, "bytes": 0, "held_bytes": 0, "deduplicated_bytes": 0}
        else:
            sizes = blocks.sizes()
            holdings = blocks.holdings()
            held = sum(h.own + h.shared for h in holdings.values())
            stored = sum(sizes.values())
            detail = {"manifests": len(holdings), "blocks": len(sizes), "bytes": stored, "held_bytes": held,
                      "deduplicated_bytes": max(0, held - stored),
                      "block_tokens": sorted({m.block_tokens for m in blocks.store.manifests()})}
    if as_json:
        click.echo(json.dumps(detail))
        return
    click.echo(f"block store: {found.store.directory / 'blocks'}")
    click.echo(f"{detail['manifests']} conversation(s) in blocks, {detail['blocks']} block(s) and tail(s), "
               f"{_size(detail['bytes'])} on disk; they hold {_size(detail['held_bytes'])} counted per "
               f"conversation ({_size(detail['deduplicated_bytes'])} not kept twice)")


def _ago(seconds: float | None, suffix: str = "", ahead: bool = False) -> str:
    if seconds is None:  # damaged, or stamped ahead of the clock: no age to give
        return "stamped ahead of the clock" if ahead else "-"
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f} {unit}{suffix}"
    return f"{max(seconds, 0):.0f} s{suffix}"


def _echo_shared(url: str, listing: SharedListing) -> None:
    """The shared tier's table, under the slot directory's."""
    rows = listing.rows
    click.echo("")
    table = [("KEY", "SIBLING", "TENANT", "TOKENS", "SIZE", "GENERATION", "SAVED", "BY")]
    for row in rows:
        if row.get("damaged") is not None:
            kept = ("-", "-", "-", "-", f"damaged: {row['damaged']}")
        elif row["removed_s"] is not None or row["tokens"] is None:
            kept = ("-", "-", str(row["generation"]), f"removed {_ago(row['removed_s'], ' ago')}", row["writer"] or "-")
        else:
            kept = (f"{row['tokens']:,}", _size(row["bytes"]), str(row["generation"]), _ago(row["saved_s"], " ago"),
                    row["writer"] or "-")
        table.append((row["key"], str(row["sibling"]), row["tenant"] or "-", *kept))
    widths = [max(len(line[c]) for line in table) for c in range(len(table[0]))]
    for line in table:
        click.echo("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(line)).rstrip())
    damaged = [row for row in rows if row.get("damaged") is not None]
    held = [row for row in rows if row.get("damaged") is None and row["tokens"] is not None]
    removed = len(rows) - len(held) - len(damaged)
    click.echo(f"{len(held)} conversation file(s), {_size(sum(row['bytes'] for row in held))} in the shared tier "
               f"{url}; {removed} removed by hand" + (f"; {len(damaged)} damaged" if damaged else ""))


class _Found:
    """The sessions the options name, found when a command first uses them: a command's
    ``--help`` needs no settings file."""

    def __init__(self, config: Path | None, slot_dir: Path | None):
        self._options = (config, slot_dir)
        self._found: Sessions | None = None

    def __getattr__(self, name: str) -> Any:
        if self._found is None:
            self._found = _sessions(*self._options)
        return getattr(self._found, name)


@click.group()
@click.option("--config", type=click.Path(path_type=Path, dir_okay=False),
              help="The server's settings file (for its slot directory).")
@click.option("--slot-dir", type=click.Path(path_type=Path, file_okay=False),
              help="The slot directory (default: the settings' engine.slot_save_path).")
@click.pass_context
def sessions(ctx: click.Context, config: Path | None, slot_dir: Path | None) -> None:
    """The parked conversations: list, inspect, remove, prune.

    A session file holds a conversation as plainly as a transcript: remove the ones
    you would not keep a transcript of.
    """
    ctx.obj = _Found(config, slot_dir)

@sessions.command("ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--blocks", "blocks", is_flag=True, help="The block store's detail instead.")
@click.pass_obj
def ls(found: Sessions, as_json: bool, blocks: bool) -> None:
    """List them: key, sibling, tenant, tokens, size, age, last used, and whether the engine
    can use them. A key's siblings (conversations that share it, a file each) have a row each.

    With a shared tier (``plugins.auto_sessions.shared``), what it holds follows: each
    conversation file's generation, tokens, size, and which server saved it when, or
    when it was removed by hand (``--json``: those rows have ``"shared": true``). A head
    that cannot be read or shown is a row saying it is damaged (``"damaged"`` in
    ``--json``). A tier that cannot be read (down, or stopped answering part way) leaves
    the slot directory's rows and what was read of the tier, says so on stderr, and
    exits 1.

    A conversation parked in blocks of tokens (``blocks = true``) shows the bytes it
    holds alone (SIZE) and those it shares with others of its tenant (SHARED); the
    total counts each block once. ``--blocks``: the block store itself."""
    if blocks:
        _echo_blocks(found, as_json)
        return
    with found.store.lock():
        rows = found.rows()
        total = found.store.usage()[1]
    listing = _read_shared(found) if found.shared is not None else SharedListing([])
    if as_json:
        for row in rows + listing.rows:
            click.echo(json.dumps(row))
    else:
        in_blocks = found.store.blocks is not None
        table = [("KEY", "SIBLING", "TENANT", "TOKENS", "SIZE", *(("SHARED",) if in_blocks else ()), "AGE",
                  "LAST USED", "COMPATIBLE")]
        table += [(row["key"], "-" if row["sibling"] is None else str(row["sibling"]), row["tenant"] or "-",
                   "-" if row["tokens"] is None else f"{row['tokens']:,}",
                   _size(row.get("own_bytes", row["bytes"])),
                   *((_size(row.get("shared_bytes", 0)),) if in_blocks else ()),
                   _ago(row["age_s"], ahead=row.get("stamped_ahead", False)),
                   _ago(row["last_used_s"], " ago", ahead=row.get("stamped_ahead", False)), row["compatible"])
                  for row in rows]
        last = len(table[0]) - 1
        widths = [max(len(line[c]) for line in table) for c in range(last)]
        for line in table:
            click.echo("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(line[:last])) + "  "
                       + line[last])
        damaged = sum(row["bytes"] for row in rows if row.get("damaged") is not None)
        click.echo(f"{len(rows)} session(s), {_size(total + damaged)} in {found.store.directory}"
                   + (" (a block several hold counted once)" if in_blocks else ""))
        if found.shared is not None and (listing.rows or listing.error is None):
            _echo_shared(found.shared.url, listing)
    if listing.error is not None:
        assert found.shared is not None
        # A partial listing: what could be read is shown, and the exit code says it is
        # not all (1, as ``ls`` of a directory it cannot wholly read exits).
        read = "the rows above are the slot directory's" + (" and what was read of the tier before"
                                                             if listing.rows else "")
        click.echo(f"the shared tier {found.shared.url} could not be read ({read}): {listing.error}", err=True)
        click.get_current_context().exit(1)

@sessions.command()
@click.argument("key")
@click.pass_obj
def inspect(found: Sessions, key: str) -> None:
    """Show one: its file, whether it is intact and usable, and its sidecar (each of its
    siblings', when several conversations share the key)."""
    with found.store.lock():
        try:
            sidecars = [s for s in found.store.siblings(key) if found.store.stage(key, s.sibling)]
        except ValueError:  # not a key strata-serve makes: there is no such session
            sidecars = []
        if not sidecars:
            raise click.ClickException(f"no session {key!r} in {found.store.directory}")
        engine = found.store.engine_description()
        shown = []
        for sidecar in sorted(sidecars, key=lambda s: s.sibling):
            path = found.store.bin_path(key, sidecar.sibling)
            if found.store.restorable(key, sidecar.sibling):
                intact = path.stat().st_size == sidecar.bytes and digest_matches(path, sidecar.digest)
            else:  # in blocks: its manifest and every block it names (each checked when joined)
                intact = found.store.intact(key, sidecar)
            shown.append((sidecar, path, intact, found.compatible(sidecar, engine)))
    for n, (sidecar, path, intact, compatible) in enumerate(shown):
        record = json.loads(json.dumps(sidecar.__dict__))
        prompt = record.get("prompt") or {}
        if "chain" in prompt:  # digests, not text: their number says enough
            prompt["chain"] = f"{len(prompt['chain'])} message boundaries"
            prompt.pop("sizes", None)
        if n:
            click.echo("")
        if path.is_file():
            click.echo(f"file: {path} ({_size(path.stat().st_size)})")
        else:
            click.echo(f"file: in blocks under {found.store.directory / 'blocks'} "
                       f"({_size(found.store.size_of(key, sidecar.sibling))} of blocks)")
        if len(shown) > 1:
            click.echo(f"sibling: {sidecar.sibling} of {len(shown)} conversations under this key")
        click.echo(f"tenant: {tenant_of(key, sidecar) or '-'}")
        differs = "no: its size or sampled digest differs from when it was saved"
        click.echo(f"intact: {'yes' if intact else differs}")
        click.echo(f"compatible: {compatible}")
        click.echo(json.dumps(record, indent=2))

@sessions.command()
@click.argument("keys", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Remove every session.")
@click.option("--tenant", help="Remove every session of this tenant.")
@click.pass_obj
def rm(found: Sessions, keys: tuple[str, ...], everything: bool, tenant: str | None) -> None:
    """Remove sessions: KEY..., --all, or --tenant T.

    A key's every file goes (its siblings: conversations that share the key). A
    running server that holds one of them in its slot, saved or not yet, drops
    its saves of it and erases the slot.

    With a shared tier, each key chosen is removed there too (a tombstone), and
    --all and --tenant T take the conversations the tier holds with no file here as
    well. A tier that cannot be read removes nothing.
    """
    if sum((bool(keys), everything, tenant is not None)) != 1:
        raise click.UsageError("give KEY..., --all or --tenant T (one of them)")
    not_keys = [key for key in keys if not _is_key(key)]
    if not_keys:
        raise click.ClickException(f"no session {', '.join(map(repr, not_keys))}: not a conversation key "
                                   "(letters, digits, _ and - make one); nothing removed")
    # The shared tier is read before the store's lock is taken (the running server takes
    # it around each save): a slow tier never holds up the server's saves.
    live: dict[str, list[dict[str, Any]]] = {}
    damaged: dict[str, str] = {}
    if found.shared is not None:
        listing = _read_shared(found)
        if listing.error is not None:
            raise click.ClickException(f"the shared tier {found.shared.url} could not be read: "
                                       f"{listing.error}; nothing removed")
        live, damaged = listing.live(), listing.damaged()
    with found.store.lock():
        parked = dict(found.store.sessions())  # a key once, whatever its siblings
        # Held by a running server and not saved yet: no file, yet theirs to remove.
        held = [key for key in found.store.held_by_server() if key not in parked]
        # Held by the shared tier alone: no file here, none in a slot of this server (a key
        # whose head there is damaged is chosen too: its removal fails, and says why).
        shared_only = [key for key in [*live, *damaged] if key not in parked and key not in held]
        shared_only = list(dict.fromkeys(shared_only))
        if everything:
            chosen = list(parked) + held + shared_only
        elif tenant is not None:
            chosen = [key for key, sidecar in parked.items() if tenant_of(key, sidecar) == tenant]
            chosen += [key for key in held + shared_only if strata_serve.tenant_of(key) == tenant]
        else:
            unknown = [key for key in keys if key not in parked and key not in held and key not in live
                       and key not in damaged]
            if unknown:
                where = f"{found.store.directory}" + (" or the shared tier" if found.shared is not None else "")
                raise click.ClickException(f"no session {', '.join(map(repr, unknown))} in {where}; "
                                           "nothing removed")
            chosen = list(dict.fromkeys(keys))
        removed = dict(found.store.remove_by_hand(chosen))
    for key in chosen:
        if key in removed:
            click.echo(f"removed {key} ({_size(removed[key])})")
        elif key in held:
            click.echo(f"removed {key}: held by the running server, not saved yet; it is never written, "
                       "and the server erases it from its slot when it would save it")
    failed: dict[str, str] = {}
    if found.shared is not None and chosen:
        names, failed = _remove_shared(found, chosen)
        failed = {key: damaged.get(key, why) for key, why in failed.items()}
        for key in chosen:
            if key not in removed and key not in held and key not in failed:
                click.echo(f"removed {key}: the shared tier held it alone")
        for name in names:
            click.echo(f"removed {name} from the shared tier")
    click.echo(f"{sum(key in removed or key in held or key not in failed for key in chosen)} session(s) removed")
    if failed:
        raise click.ClickException(
            "not removed from the shared tier: " + "; ".join(f"{key} ({why})" for key, why in failed.items())
            + "; run rm again once the tier answers (a damaged head is for its store's own tools to remove)")

@sessions.command()
@click.option("--max-gb", type=float, required=True, help="Keep at most this many GB, newest first.")
@click.pass_obj
def prune(found: Sessions, max_gb: float) -> None:
    """Remove the least recently used sessions until they fit in --max-gb.

    A running server saves the conversation its slot holds again when it leaves the
    slot, if its file was pruned (use rm to delete a conversation for good).
    """
    if max_gb < 0:
        raise click.UsageError("--max-gb must be 0 or more")
    removed = found.store.prune(keep=1 << 30, max_bytes=int(max_gb * GB))
    for key, size in removed:
        click.echo(f"pruned {key} ({_size(size)})")
    files, total = found.store.usage()
    click.echo(f"{len(removed)} session(s) pruned; {files} left, {_size(total)}")


def register(cli: click.Group) -> None:
    """Add ``strata-serve sessions`` to the command line."""
    cli.add_command(sessions)
