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

from strata_auto_sessions.parking import GB, NAME, AutoSessionsConfig
from strata_auto_sessions.config import SharedConfig
from strata_auto_sessions.clock import as_of
from strata_auto_sessions.compat import incompatibility
from strata_auto_sessions.digests import digest_matches
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
        for key, path, size, last_used in self.store.files():
            sidecar = sidecars.get(path)
            if sidecar is None:
                continue
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
            })
        for key, path, why in self.store.damaged():
            rows.append({"key": key, "sibling": None, "tenant": None, "tokens": None, "bytes": path.stat().st_size,
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
    return Sessions(SessionStore(Path(directory)), plugin.build_range, plugin.shared)


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


def _shared_keys(found: Sessions, keys: list[str]) -> set[str]:
    """Those of ``keys`` that have a file in the shared tier (none without one)."""
    if found.shared is None:
        return set()
    from strata_auto_sessions.naming import PREFIX, file_key

    timeout = found.shared.timeout_s

    async def look(tier: Any) -> set[str]:
        have = set()
        for key in keys:
            names = await asyncio.wait_for(tier.heads(f"{PREFIX}{file_key(key)}."), timeout)
            if names:
                have.add(key)
        return have

    return _run_shared(found, look)


def _shared_rows(found: Sessions) -> list[dict[str, Any]]:
    """One row per conversation file the shared tier holds a head for, newest first: its
    key, sibling, tenant, generation, and either its tokens, size and who saved it when,
    or when it was removed (a tombstone)."""
    from strata_auto_sessions.naming import PREFIX, SESSION_NAME, key_of_file, sibling_of

    assert found.shared is not None
    timeout = found.shared.timeout_s

    async def look(tier: Any) -> list[dict[str, Any]]:
        rows = []
        now = time.time()
        for name in await asyncio.wait_for(tier.heads(PREFIX), timeout):
            match = SESSION_NAME.fullmatch(name)
            if match is None or match["ext"] != "bin":
                continue  # the start check's probe, or no conversation file
            current = await asyncio.wait_for(tier.head(name), timeout)
            if current is None:
                continue  # removed since it was listed
            head, key = current[0], key_of_file(match["key"])
            rows.append({
                "shared": True, "key": key, "sibling": sibling_of(match), "tenant": strata_serve.tenant_of(key),
                "generation": head.generation, "tokens": None if head.tombstone else head.tokens,
                "bytes": None if head.tombstone else head.bytes, "saved_s": _age(head.written, now),
                "removed_s": None if head.removed is None else _age(head.removed, now),
                "writer": head.writer or None, "name": name,
            })
        return sorted(rows, key=lambda row: (row["saved_s"] is None, row["saved_s"] or 0))

    return _run_shared(found, look)


def _age(stamp: float, now: float) -> float | None:
    """Seconds since ``stamp`` (another server's clock wrote it); None when it is ahead of this one."""
    taken = as_of(stamp, now)
    return None if taken is None else now - taken


def _remove_shared(found: Sessions, keys: list[str]) -> list[str]:
    from strata_auto_sessions.shared.sync import remove_by_hand

    assert found.shared is not None
    config = found.shared
    return _run_shared(found, lambda tier: remove_by_hand(tier, config, keys))


def _size(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 100 else f"{n / 1024**2:.2f} MB"


def _ago(seconds: float | None, suffix: str = "", ahead: bool = False) -> str:
    if seconds is None:  # damaged, or stamped ahead of the clock: no age to give
        return "stamped ahead of the clock" if ahead else "-"
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f} {unit}{suffix}"
    return f"{max(seconds, 0):.0f} s{suffix}"


def _echo_shared(url: str, rows: list[dict[str, Any]]) -> None:
    """The shared tier's table, under the slot directory's."""
    click.echo("")
    table = [("KEY", "SIBLING", "TENANT", "TOKENS", "SIZE", "GENERATION", "SAVED", "BY")]
    for row in rows:
        if row["removed_s"] is not None or row["tokens"] is None:
            kept = ("-", "-", str(row["generation"]), f"removed {_ago(row['removed_s'], ' ago')}", row["writer"] or "-")
        else:
            kept = (f"{row['tokens']:,}", _size(row["bytes"]), str(row["generation"]), _ago(row["saved_s"], " ago"),
                    row["writer"] or "-")
        table.append((row["key"], str(row["sibling"]), row["tenant"] or "-", *kept))
    widths = [max(len(line[c]) for line in table) for c in range(len(table[0]))]
    for line in table:
        click.echo("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(line)).rstrip())
    held = [row for row in rows if row["tokens"] is not None]
    click.echo(f"{len(held)} conversation file(s), {_size(sum(row['bytes'] for row in held))} in the shared tier "
               f"{url}; {len(rows) - len(held)} removed by hand")


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


def register(cli: click.Group) -> None:
    @cli.group()
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
    @click.pass_obj
    def ls(found: Sessions, as_json: bool) -> None:
        """List them: key, sibling, tenant, tokens, size, age, last used, and whether the engine
        can use them. A key's siblings (conversations that share it, a file each) have a row each.

        With a shared tier (``plugins.auto_sessions.shared``), what it holds follows: each
        conversation file's generation, tokens, size, and which server saved it when, or
        when it was removed by hand (``--json``: those rows have ``"shared": true``)."""
        with found.store.lock():
            rows = found.rows()
        shared = _shared_rows(found) if found.shared is not None else []
        if as_json:
            for row in rows + shared:
                click.echo(json.dumps(row))
            return
        table = [("KEY", "SIBLING", "TENANT", "TOKENS", "SIZE", "AGE", "LAST USED", "COMPATIBLE")]
        table += [(row["key"], "-" if row["sibling"] is None else str(row["sibling"]), row["tenant"] or "-",
                   "-" if row["tokens"] is None else f"{row['tokens']:,}",
                   _size(row["bytes"]), _ago(row["age_s"], ahead=row.get("stamped_ahead", False)),
                   _ago(row["last_used_s"], " ago", ahead=row.get("stamped_ahead", False)), row["compatible"])
                  for row in rows]
        last = len(table[0]) - 1
        widths = [max(len(line[c]) for line in table) for c in range(last)]
        for line in table:
            click.echo("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(line[:last])) + "  " + line[last])
        click.echo(f"{len(rows)} session(s), {_size(sum(row['bytes'] for row in rows))} in {found.store.directory}")
        if found.shared is not None:
            _echo_shared(found.shared.url, shared)

    @sessions.command()
    @click.argument("key")
    @click.pass_obj
    def inspect(found: Sessions, key: str) -> None:
        """Show one: its file, whether it is intact and usable, and its sidecar (each of its
        siblings', when several conversations share the key)."""
        with found.store.lock():
            try:
                sidecars = [s for s in found.store.siblings(key) if found.store.restorable(key, s.sibling)]
            except ValueError:  # not a key strata-serve makes: there is no such session
                sidecars = []
            if not sidecars:
                raise click.ClickException(f"no session {key!r} in {found.store.directory}")
            engine = found.store.engine_description()
            shown = []
            for sidecar in sorted(sidecars, key=lambda s: s.sibling):
                path = found.store.bin_path(key, sidecar.sibling)
                intact = path.stat().st_size == sidecar.bytes and digest_matches(path, sidecar.digest)
                shown.append((sidecar, path, intact, found.compatible(sidecar, engine)))
        for n, (sidecar, path, intact, compatible) in enumerate(shown):
            record = json.loads(json.dumps(sidecar.__dict__))
            prompt = record.get("prompt") or {}
            if "chain" in prompt:  # digests, not text: their number says enough
                prompt["chain"] = f"{len(prompt['chain'])} message boundaries"
                prompt.pop("sizes", None)
            if n:
                click.echo("")
            click.echo(f"file: {path} ({_size(path.stat().st_size)})")
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
        """
        if sum((bool(keys), everything, tenant is not None)) != 1:
            raise click.UsageError("give KEY..., --all or --tenant T (one of them)")
        with found.store.lock():
            parked = dict(found.store.sessions())  # a key once, whatever its siblings
            # Held by a running server and not saved yet: no file, yet theirs to remove.
            held = [key for key in found.store.held_by_server() if key not in parked]
            if everything:
                chosen = list(parked) + held
            elif tenant is not None:
                chosen = [key for key, sidecar in parked.items() if tenant_of(key, sidecar) == tenant]
                chosen += [key for key in held if strata_serve.tenant_of(key) == tenant]
            else:
                shared = _shared_keys(found, list(keys))
                unknown = [key for key in keys if key not in parked and key not in held and key not in shared]
                if unknown:
                    raise click.ClickException(f"no session {', '.join(map(repr, unknown))} in "
                                               f"{found.store.directory}; nothing removed")
                chosen = list(keys)
            removed = dict(found.store.remove_by_hand(chosen))
        for key in chosen:
            if key in removed:
                click.echo(f"removed {key} ({_size(removed[key])})")
            else:
                click.echo(f"removed {key}: held by the running server, not saved yet; it is never written, "
                           "and the server erases it from its slot when it would save it")
        if found.shared is not None:
            for name in _remove_shared(found, chosen):
                click.echo(f"removed {name} from the shared tier")
        click.echo(f"{len(chosen)} session(s) removed")

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
