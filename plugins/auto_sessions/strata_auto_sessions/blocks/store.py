"""A store of state blocks: each block written once, conversations kept as small manifests.

On disk, under one directory (private, 0700; every file 0600)::

    objects/ab/abcd…    a block or a tail (objects.py), named by its chained hash (a
                         tail: by the hash of its bytes); written once, never changed
    manifests/<h>.json  a conversation: its key, its chain of blocks and its tail,
                         what they were cut under; replaced atomically at each save

A save cuts the engine's file (``StateFormat.cut``), writes the blocks the store lacks
and the tail, then the manifest. A restore finds the longest chain of stored blocks that
prefixes a prompt's tokens, from any manifest of the tenant (``longest_prefix``), and
joins it into a file the engine reads (``materialize``). Pruning removes manifests
(least recently used first) and then the objects no manifest holds.

One process writes a store at a time (its saves and prunes take the store's lock);
an object younger than ``grace_s`` is never removed, so a save under way elsewhere,
whose manifest is not written yet, keeps its blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from strata_serve import PRIVATE_FILE_MODE, CutState, StateBlock, StateFormat, StateRefusal, make_private_dir, tenant_of

from strata_auto_sessions.blocks import objects
from strata_auto_sessions.blocks.names import chain_names, root_name

__all__ = ["BlockStore", "Chain", "Manifest", "PruneReport", "SaveReport", "StoreUsage"]

MANIFEST_VERSION = 1
#: A file of the store's root, rewritten whenever objects are added or removed: another
#: process's store lists the objects again once it changed (:meth:`BlockStore.object_sizes`).
GENERATION_NAME = ".generation"
#: Tokens a block holds unless told otherwise. Measured (bench/blocks.py, bench/results/blocks.md):
#: six sessions sharing a 2,289-token opening take 1.06x their distinct tokens' bytes in
#: blocks of 64 and 1.27x in blocks of 256 (the opening's last, partial block and each tail
#: are stored per session), and a turn writes 1.1x its new tokens' bytes against up to 1.6x
#: (a save writes the tail again); saving and joining take about as long either way.
DEFAULT_BLOCK_TOKENS = 64
#: Blocks of one join mapped from their files at most (each mapping holds a file
#: descriptor until the join ends); the rest are read into memory.
MAPPED_BLOCKS = 256


@dataclass(frozen=True)
class Manifest:
    """A conversation as the store keeps it."""

    key: str
    tenant: str | None
    #: The state format's version and the layout record the blocks were cut under.
    format_version: str
    layout: str
    n_stream: int
    block_tokens: int
    root: str
    chain: list[str]
    #: The tail's object (the tokens past the last whole block); None when there are none.
    tail: str | None
    tail_tokens: list[int]
    tokens: int
    saved_at: float = 0.0
    #: A sliding-window model's window object (the window cache's cells before the state's
    #: end, :attr:`CutState.window`): the state restores only whole, at that end.
    window: str | None = None

    def objects(self) -> list[str]:
        return [*self.chain, *([self.tail] if self.tail else []), *([self.window] if self.window else [])]

    @property
    def identity(self) -> tuple[object, ...]:
        """What tells this state from any other (its objects are named by their content)."""
        return (self.root, self.tokens, tuple(self.chain), self.tail, self.window)


@dataclass(frozen=True)
class Chain:
    """Stored blocks that prefix a prompt (``BlockStore.longest_prefix``)."""

    layout: str
    n_stream: int
    block_tokens: int
    names: list[str]
    #: A manifest's tail that continues the blocks along the prompt, when one does.
    tail: str | None
    #: The prompt's tokens the chain holds (whole blocks and the tail).
    tokens: int
    #: The manifest the chain was found in (touched when it is restored).
    source: str | None = None
    #: The source's window object, for a sliding-window model's state (then the chain is
    #: that manifest's whole state).
    window: str | None = None


@dataclass(frozen=True)
class SaveReport:
    """What one save did. ``refused``: the state is not in blocks (the caller keeps it whole)."""

    key: str
    tokens: int = 0
    blocks: int = 0
    blocks_written: int = 0
    #: Bytes that reached the disk: new blocks, the tail and the manifest.
    bytes_written: int = 0
    #: The engine's bytes of the state (what a whole file holds, without its header).
    state_bytes: int = 0
    refused: StateRefusal | None = None
    #: The files this save wrote (new objects, the manifest): not yet fsynced when the
    #: store does not fsync (the caller syncs them off the request's path).
    paths: tuple[Path, ...] = ()


@dataclass(frozen=True)
class PruneReport:
    manifests_removed: list[str] = field(default_factory=list)
    objects_removed: int = 0
    bytes_freed: int = 0


@dataclass(frozen=True)
class StoreUsage:
    manifests: int
    objects: int
    #: Bytes of every object, each counted once however many manifests hold it.
    bytes: int


class BlockStore:
    """Blocks of engine state, written once, under chained names (see the module's docstring)."""

    def __init__(
        self,
        root: Path,
        state_format: StateFormat,
        *,
        fingerprint: Mapping[str, Any],
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        compression: str | None = None,
        fsync: bool = False,
        grace_s: float = 300.0,
    ):
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        if compression not in objects.COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}")
        self.root = Path(root)
        self.format = state_format
        self.fingerprint = dict(fingerprint)
        self.block_tokens = block_tokens
        self.compression = compression
        self.fsync = fsync
        self.grace_s = grace_s
        self._lock = threading.RLock()
        #: Objects read back intact or written here: not digested again while unchanged.
        self._verified = objects.Verified()
        self._objects = self.root / "objects"
        self._manifests = self.root / "manifests"
        for path in (self.root, self._objects, self._manifests):
            make_private_dir(path)
        #: Each object's bytes, as last listed or changed here; valid while the generation
        #: file still says :attr:`_mark` (no other process added or removed objects since).
        self._sizes: dict[str, int] | None = None
        self._mark: str | None = None
        #: Objects a reader of this process holds (an upload sending them): never removed
        #: by :meth:`prune` while held, whether or not a manifest still names them.
        self._pinned: Counter[str] = Counter()

    # -- paths ---------------------------------------------------------------------------

    def _object_path(self, name: str) -> Path:
        return self._objects / name[:2] / name

    def _manifest_path(self, key: str) -> Path:
        return self._manifests / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.json"

    def has(self, name: str) -> bool:
        return self._object_path(name).is_file()

    # -- what the objects weigh ----------------------------------------------------------

    def _generation(self) -> str | None:
        try:
            return (self.root / GENERATION_NAME).read_text()
        except (FileNotFoundError, UnicodeDecodeError):
            return None

    def object_sizes(self) -> dict[str, int]:
        """Each object's bytes (temporaries left out): listed from the directory once, then
        kept as this store changes them, and listed again once another process (``sessions
        rm``) changed the objects."""
        with self._lock:
            mark = self._generation()
            if self._sizes is None or mark != self._mark:
                self._sizes = {n: st.st_size for n, st in self._object_files().items() if not n.startswith(".")}
                self._mark = mark
            return dict(self._sizes)

    def objects_changed(self, added: Mapping[str, int] | None = None, removed: Iterable[str] = ()) -> None:
        """Objects were added (name: bytes) or removed: the kept sizes follow, and the
        generation file is rewritten, so that other processes list them again. ``added``
        None: not known which (the sizes are listed again). Under the directory's lock."""
        with self._lock:
            current = self._sizes is not None and self._generation() == self._mark
            mark = os.urandom(8).hex()
            path = self.root / GENERATION_NAME
            tmp = path.with_name(f"{GENERATION_NAME}.{mark}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)  # whatever the umask
                with os.fdopen(fd, "w") as f:
                    f.write(mark)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk must not leave the temporary behind
                raise
            if not current or added is None or self._sizes is None:
                self._sizes, self._mark = None, None
                return
            self._sizes.update(added)
            for name in removed:
                self._sizes.pop(name, None)
            self._mark = mark

    # -- saving --------------------------------------------------------------------------

    def save(self, manifest_key: str, staged_file: Path) -> SaveReport:
        """Cut the engine's file at ``staged_file`` and keep it as ``manifest_key``'s state:
        only the blocks the store lacks are written. The staged file is left to the caller."""
        cut = self.format.cut(Path(staged_file), self.block_tokens)
        if isinstance(cut, StateRefusal):
            return SaveReport(key=manifest_key, refused=cut)
        return self.save_cut(manifest_key, cut)

    def save_cut(self, manifest_key: str, cut: CutState) -> SaveReport:
        tenant = tenant_of(manifest_key)
        root = root_name(format_version=self.format.version, fingerprint=self.fingerprint, layout=cut.layout,
                         tenant=tenant)
        names = list(chain_names(root, cut.tokens[:len(cut.blocks) * cut.block_tokens], cut.block_tokens))
        written = 0
        new_blocks = 0
        added: dict[str, int] = {}
        with self._lock:
            for i, name in enumerate(names):
                if self.has(name):
                    continue  # its data is never read out of the cut file
                n = self._publish(name, cut.blocks[i])
                if n:
                    new_blocks += 1
                    written += n
                    added[name] = n
            tail_name = self._publish_end(b"tail", root, cut.tail, added) if cut.tail.tokens else None
            window_name = self._publish_end(b"window", root, cut.window, added) if cut.window else None
            written += sum(added[name] for name in (tail_name, window_name) if name in added)
            if added:
                self.objects_changed(added)
            manifest = Manifest(
                key=manifest_key, tenant=tenant, format_version=self.format.version, layout=cut.layout.decode(),
                n_stream=cut.n_stream, block_tokens=cut.block_tokens, root=root, chain=names, tail=tail_name,
                tail_tokens=list(cut.tail.tokens), tokens=len(cut.tokens), saved_at=time.time(), window=window_name,
            )
            written += self._write_manifest(manifest)
        paths = (*(self._object_path(name) for name in added), self._manifest_path(manifest_key))
        return SaveReport(key=manifest_key, tokens=len(cut.tokens), blocks=len(names), blocks_written=new_blocks,
                          bytes_written=written, state_bytes=cut.state_bytes, paths=paths)

    def _publish_end(self, kind: bytes, root: str, block: StateBlock, added: dict[str, int]) -> str:
        """Store a state's tail or window (named by ``kind``, the root and its bytes) unless
        the store has it; its name (``added`` gets it with its bytes when written)."""
        raw = objects.encode_parts(block, self.compression)
        digest = hashlib.sha256(kind + b"\0" + root.encode())
        for part in raw:
            digest.update(part)
        name = digest.hexdigest()
        if not self.has(name) and (n := self._publish_raw(name, raw)):
            added[name] = n
        return name

    def _publish(self, name: str, block: StateBlock) -> int:
        return self._publish_raw(name, objects.encode_parts(block, self.compression))

    def _publish_raw(self, name: str, raw: list[bytes | memoryview]) -> int:
        path = self._object_path(name)
        make_private_dir(path.parent)
        if not objects.publish(path, raw, fsync=self.fsync):
            return 0
        try:
            self._verified.add(name, path.stat())  # its digest was taken from the bytes written
        except FileNotFoundError:
            pass
        return sum(len(part) for part in raw)

    def _write_manifest(self, manifest: Manifest) -> int:
        raw = json.dumps({"version": MANIFEST_VERSION, **asdict(manifest)}, separators=(",", ":")).encode()
        path = self._manifest_path(manifest.key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
        except FileNotFoundError:  # the directory was removed under the running server
            make_private_dir(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return len(raw)

    # -- reading -------------------------------------------------------------------------

    def manifests(self) -> list[Manifest]:
        found = []
        for path in self._manifests.glob("*.json"):
            manifest = self._read_manifest(path)
            if manifest is not None:
                found.append(manifest)
        return found

    def manifest(self, key: str) -> Manifest | None:
        return self._read_manifest(self._manifest_path(key))

    @staticmethod
    def _read_manifest(path: Path) -> Manifest | None:
        try:
            d = json.loads(path.read_bytes())
            if d.pop("version") != MANIFEST_VERSION:
                return None
            return Manifest(**d)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def longest_prefix(self, tenant: str | None, tokens: Sequence[int]) -> Chain | None:
        """The longest chain of stored blocks of ``tenant`` that prefixes ``tokens`` (walked
        along the prompt's names to the first block the store lacks), continued by a
        manifest's tail where one continues it along the prompt; None when no block matches."""
        tokens = list(tokens)
        # the tenant's manifests saved under this store's format and model (their root says so)
        ours = [m for m in self.manifests() if m.tenant == tenant and m.format_version == self.format.version
                and m.root == root_name(format_version=self.format.version, fingerprint=self.fingerprint,
                                        layout=m.layout.encode(), tenant=tenant)]
        best: Chain | None = None
        for root in {m.root for m in ours}:
            of_root = [m for m in ours if m.root == root]
            sample = of_root[0]
            names: list[str] = []
            for name in chain_names(root, tokens, sample.block_tokens):
                if not self.has(name):
                    break
                names.append(name)
            matched = len(names) * sample.block_tokens
            if sample.window is not None:
                found = self._whole_state(of_root, names, tokens)
                if found is not None and (best is None or found.tokens > best.tokens):
                    best = found
                continue
            tail, source, tail_tokens = None, None, 0
            for m in of_root:
                if m.chain == names and m.tail and tokens[matched:matched + len(m.tail_tokens)] == m.tail_tokens \
                        and len(m.tail_tokens) > tail_tokens and self.has(m.tail):
                    tail, source, tail_tokens = m.tail, m.key, len(m.tail_tokens)
            if source is None and names:
                source = next((m.key for m in of_root if m.chain[:len(names)] == names), None)
            total = matched + tail_tokens
            if total and (best is None or total > best.tokens):
                best = Chain(layout=sample.layout, n_stream=sample.n_stream, block_tokens=sample.block_tokens,
                             names=names, tail=tail, tokens=total, source=source)
        return best

    def _whole_state(self, manifests: list[Manifest], names: list[str], tokens: Sequence[int]) -> Chain | None:
        """Of sliding-window states (restored only whole, at the end their window was cut at),
        the longest whose whole state prefixes the prompt (``names``: the prompt's stored
        blocks along it)."""
        best: Manifest | None = None
        for m in manifests:
            whole = len(m.chain) * m.block_tokens
            if (names[:len(m.chain)] == m.chain and (best is None or m.tokens > best.tokens)
                    and (not m.tail or (list(tokens[whole:whole + len(m.tail_tokens)]) == m.tail_tokens
                                        and self.has(m.tail)))
                    and m.window is not None and self.has(m.window)):
                best = m
        return None if best is None else self._chain(best)

    def matched(self, key: str, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, ``key``'s stored state holds (its blocks
        along the prompt's names, then its tail); 0 when the store has no manifest for it."""
        m = self.manifest(key)
        if m is None:
            return 0
        whole = 0
        for mine, theirs in zip(m.chain, chain_names(m.root, tokens, m.block_tokens)):
            if mine != theirs:
                break
            whole += 1
        matched = whole * m.block_tokens
        if whole == len(m.chain) and m.tail_tokens \
                and list(tokens[matched:matched + len(m.tail_tokens)]) == m.tail_tokens:
            matched += len(m.tail_tokens)
        return matched

    def chain_of(self, key: str) -> Chain | None:
        """The whole of ``key``'s stored state, as a chain; None when the store has no manifest for it."""
        m = self.manifest(key)
        return None if m is None else self._chain(m)

    @staticmethod
    def _chain(m: Manifest) -> Chain:
        return Chain(layout=m.layout, n_stream=m.n_stream, block_tokens=m.block_tokens, names=list(m.chain),
                     tail=m.tail, tokens=m.tokens, source=m.key, window=m.window)

    def materialize(self, chain: Chain, dest: Path) -> int:
        """Join ``chain``'s blocks (and its tail) into an engine file at ``dest``; returns its bytes.

        :raises objects.CorruptBlock: a block missing or not as it was written.
        """
        with self._lock:
            names = [*chain.names, *([chain.tail] if chain.tail else [])]
            blocks = [self._read(name, mapped=i < MAPPED_BLOCKS) for i, name in enumerate(names)]
            window = self._read(chain.window) if chain.window else None
            if chain.source is not None:
                self._touch(chain.source)
        return self.format.join(chain.layout.encode(), blocks, Path(dest), n_stream=chain.n_stream, window=window)

    def _read(self, name: str, *, mapped: bool = False) -> StateBlock:
        """The stored block ``name``, checked against its digest unless this process
        wrote it or checked this very file before; ``mapped``: its data a view of the file."""
        path = self._object_path(name)
        try:
            return objects.load(path, name, self._verified, mapped=mapped)
        except FileNotFoundError:
            raise objects.CorruptBlock(f"block {name[:16]} is missing") from None
        except objects.CorruptBlock:
            # Gone, so that the next save of any conversation holding it writes it anew
            # (a save skips the blocks the store has).
            self._verified.forget(name)
            path.unlink(missing_ok=True)
            self.objects_changed({}, [name])
            raise

    def _touch(self, key: str) -> None:
        try:
            os.utime(self._manifest_path(key))
        except FileNotFoundError:
            pass

    # -- holding objects for a reader --------------------------------------------------

    def pin(self, names: Iterable[str]) -> None:
        """Hold ``names`` (a manifest's objects) until :meth:`unpin`: :meth:`prune` spares
        them even once no manifest names them (an upload still sends them)."""
        with self._lock:
            self._pinned.update(set(names))

    def unpin(self, names: Iterable[str]) -> None:
        """Let go of what :meth:`pin` held (objects no manifest names go at the next prune)."""
        with self._lock:
            self._pinned.subtract(set(names))
            self._pinned = +self._pinned

    # -- removing ------------------------------------------------------------------------

    def remove(self, key: str) -> bool:
        """Forget ``key``'s manifest (its blocks go at the next prune, unless another holds them)."""
        with self._lock:
            try:
                self._manifest_path(key).unlink()
            except FileNotFoundError:
                return False
            return True

    def _object_files(self) -> dict[str, os.stat_result]:
        found = {}
        for sub in self._objects.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                try:
                    found[path.name] = path.stat()
                except FileNotFoundError:
                    continue
        return found

    def usage(self) -> StoreUsage:
        sizes = self.object_sizes()
        return StoreUsage(manifests=len(self.manifests()), objects=len(sizes), bytes=sum(sizes.values()))

    def prune(self, *, keep: int | None = None, max_bytes: int | None = None) -> PruneReport:
        """Keep at most ``keep`` manifests and ``max_bytes`` of objects, least recently used
        manifests removed first; then remove every object no remaining manifest holds."""
        with self._lock:
            used = []
            for m in self.manifests():
                try:
                    used.append((self._manifest_path(m.key).stat().st_mtime, m))
                except FileNotFoundError:
                    continue
            used.sort(key=lambda x: x[0], reverse=True)
            kept = [m for _, m in used]
            files = self._object_files()
            removed: list[str] = []

            def size_of(ms: list[Manifest]) -> int:
                held = {n for m in ms for n in m.objects()}
                return sum(files[n].st_size for n in held if n in files)

            while kept and ((keep is not None and len(kept) > keep)
                            or (max_bytes is not None and size_of(kept) > max_bytes)):
                gone = kept.pop()
                self._manifest_path(gone.key).unlink(missing_ok=True)
                removed.append(gone.key)
            held = {n for m in self.manifests() for n in m.objects()}
            now = time.time()
            n_removed = freed = 0
            freed_names: list[str] = []
            for name, st in files.items():
                if name in held or name in self._pinned or now - st.st_mtime < self.grace_s:
                    continue
                # A temporary a killed save left (``.<name>...tmp``) sits beside its object.
                path = self._objects / (name.lstrip(".")[:2]) / name
                self._verified.forget(name)
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                n_removed += 1
                freed += st.st_size
                freed_names.append(name)
            if freed_names:
                self.objects_changed({}, freed_names)
            return PruneReport(manifests_removed=removed, objects_removed=n_removed, bytes_freed=freed)
