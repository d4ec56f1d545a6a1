"""Settings plugins change go through ``adjust_settings``, which runs before any ``on_config``."""

from __future__ import annotations

from pathlib import Path

import pytest

import strata_auto_sessions
import strata_serve
from strata_serve.config import ConfigError, Settings
from strata_serve.plugins import get_plugin_manager


class EarlyCheck:
    """Validates before every other plugin (``tryfirst``), so sees what adjust_settings left."""

    strata_name = "early_check"

    def __init__(self):
        self.events: list[tuple[str, object]] = []

    @strata_serve.hookimpl(tryfirst=True)
    def adjust_settings(self, settings):
        self.events.append(("adjust", settings.engine.slot_save_path))

    @strata_serve.hookimpl(tryfirst=True)
    def on_config(self, settings):
        self.events.append(("check", settings.engine.slot_save_path))


def with_slot_dir(path: Path) -> Settings:
    return Settings(engine={"model": "/models/m.gguf"}, plugins={"auto_sessions": {"slot_dir": str(path)}})


def test_every_on_config_sees_the_settings_after_every_adjustment(tmp_path):
    early = EarlyCheck()
    settings = with_slot_dir(tmp_path / "slots")
    get_plugin_manager(settings, entrypoints=False, plugins=[strata_auto_sessions, early])
    # The early plugin adjusts first (tryfirst), before auto-sessions gave the engine its
    # directory; its check, also first among the checks, already sees that directory.
    assert early.events == [("adjust", None), ("check", tmp_path / "slots")]
    assert settings.engine.slot_save_path == tmp_path / "slots"


def test_auto_sessions_on_config_changes_nothing(tmp_path):
    settings = with_slot_dir(tmp_path / "slots")
    before = settings.model_dump()
    with pytest.raises(ConfigError, match=r"slot_dir .* must be the engine's slot directory"):
        strata_auto_sessions.on_config(settings=settings)  # alone, without adjust_settings first
    assert settings.model_dump() == before


def test_a_slot_dir_other_than_the_engines_is_still_refused(tmp_path):
    settings = with_slot_dir(tmp_path / "slots")
    settings.engine.slot_save_path = tmp_path / "elsewhere"
    with pytest.raises(ConfigError, match="must be the engine's slot directory"):
        get_plugin_manager(settings, entrypoints=False, plugins=[strata_auto_sessions])
    assert settings.engine.slot_save_path == tmp_path / "elsewhere", "an engine directory set is never changed"
