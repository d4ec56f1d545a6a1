"""The llama.cpp quirk rules, verdict by verdict, and the plugin on and off (no engine runs here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import strata_auto_sessions
import strata_quirks_llama_cpp
from strata_serve import EngineError, Verdict
from strata_serve.config import ConfigError, EngineSettings, Settings
from strata_serve.engine import EngineInfo, LlamaServer
from strata_serve.plugins import first_result, get_plugin_manager



@pytest.fixture
def engine_for(strata_demo_model, tmp_path):
    """``engine_for(**engine_settings)``: a llama-server backend, never started (only its ``info`` is read)."""

    def make(**settings):
        return LlamaServer(EngineSettings(model=strata_demo_model, slot_save_path=tmp_path / "slots", **settings))

    return make


#: One stand-in service per engine object: the plugin keeps its counts in ``service.state``.
_services: list[tuple[object, SimpleNamespace]] = []


@pytest.fixture(autouse=True)
def fresh_services():
    yield
    _services.clear()


def service_of(engine) -> SimpleNamespace:
    service = next((service for known, service in _services if known is engine), None)
    if service is None:
        service = SimpleNamespace(state={})
        _services.append((engine, service))
    return service


def verdict(engine, op, error=None, held_tokens=None):
    return strata_quirks_llama_cpp.engine_verdict(op=op, error=error, engine=engine, held_tokens=held_tokens,
                                                  service=service_of(engine))


def unused(engine):
    """auto-sessions' question: a restore of 900 tokens, of which the next request reused 3."""
    return strata_quirks_llama_cpp.auto_sessions_restore_unused(engine=engine, service=service_of(engine))


def quirk_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "strata_quirks_llama_cpp"]


# -- an empty slot ------------------------------------------------------------------

@pytest.mark.parametrize("op, held_tokens, expected", [
    ("save", 0, Verdict.SKIP),
    ("save", None, None),       # not known to be empty: no guess
    ("save", 1200, None),
    ("restore", 0, None),       # restoring into an empty slot is what restores are for
])
def test_a_known_empty_slot_is_not_saved(engine_for, op, held_tokens, expected):
    assert verdict(engine_for(), op, held_tokens=held_tokens) == expected


# -- multimodal (--mmproj), and any slot call the engine does not support -------------

def test_a_multimodal_engine_is_not_refused_in_advance(engine_for, tmp_path):
    # Whether --mmproj blocks slot files depends on the build (the one here allows them).
    engine = engine_for(mmproj=tmp_path / "mmproj.gguf")
    assert engine.info.multimodal
    for op in ("save", "restore", "erase"):
        assert verdict(engine, op, held_tokens=1200) is None


def test_the_multimodal_refusal_is_unsupported_said_once(engine_for, tmp_path, caplog):
    engine = engine_for(mmproj=tmp_path / "mmproj.gguf")
    refusal = "This feature is not supported by multimodal"
    for op in ("save", "restore", "save"):
        assert verdict(engine, op, EngineError(op=op, status=501, message=refusal), 1200) == Verdict.UNSUPPORTED
    lines = quirk_lines(caplog)
    assert len(lines) == 1 and "--mmproj" in lines[0] and "21133" in lines[0] and refusal in lines[0]
    assert lines[0].startswith("[strata] quirks llama.cpp: ")


def test_not_supported_is_unsupported_even_when_the_flags_are_unknown(engine_for, caplog):
    # Attached by URL, strata-serve cannot see the engine's flags: its own 501 says it.
    engine = engine_for()
    refusal = EngineError(op="save", status=501, message="This feature is not supported by multimodal")
    assert verdict(engine, "save", refusal, 1200) == Verdict.UNSUPPORTED
    assert "21133" not in quirk_lines(caplog)[0], "no guess about why"


# -- a refused filename -------------------------------------------------------------

@pytest.mark.parametrize("multimodal", [False, True])
def test_invalid_filename_is_a_plain_error(engine_for, tmp_path, multimodal):
    engine = engine_for(mmproj=tmp_path / "mmproj.gguf" if multimodal else None)
    refused = EngineError(op="save", status=400, message="Invalid filename")
    assert verdict(engine, "save", refused, 1200) is None


@pytest.mark.parametrize("error", [
    EngineError(op="save", status=500, message="failed to open file"),
    EngineError(op="restore", status=400, message="Unable to restore slot, no available space in KV cache or invalid slot save file"),
    EngineError(op="save", message="the engine did not answer"),
], ids=["save-500", "restore-400", "no-answer"])
def test_other_failures_are_plain_errors(engine_for, error):
    assert verdict(engine_for(), error.op, error, 1200) is None


# -- restores that are not reused ---------------------------------------------------

def test_second_unreused_restore_of_a_model_stops_parking_said_once(engine_for, caplog):
    engine = engine_for()
    assert unused(engine) is None
    assert unused(engine) == Verdict.UNSUPPORTED
    assert unused(engine) == Verdict.UNSUPPORTED
    lines = quirk_lines(caplog)
    assert len(lines) == 1
    assert engine.info.model_path in lines[0] and "25913" in lines[0] and "parking pauses" in lines[0]


def test_unreused_restores_are_counted_per_model(engine_for):
    engine = engine_for()
    first_model = engine.info.model_path
    assert unused(engine) is None
    engine.info.model_path = "/models/another.gguf"  # an attached engine now serving another model
    assert unused(engine) is None
    engine.info.model_path = first_model
    assert unused(engine) == Verdict.UNSUPPORTED


def test_unreused_restores_are_counted_per_engine(engine_for):
    one, other = engine_for(), engine_for()
    assert unused(one) is None
    assert unused(other) is None, "another server's count is its own"


# -- which engines, and the plugin on and off ----------------------------------------

def test_another_backend_gets_no_answer():
    engine = SimpleNamespace(info=EngineInfo(url="http://elsewhere", multimodal=True))
    assert verdict(engine, "save", held_tokens=0) is None
    assert unused(engine) is None


@pytest.mark.parametrize("plugins_config, expected", [
    ({}, Verdict.SKIP),
    ({"quirks_llama_cpp": {"enabled": False}}, None),
])
def test_registered_it_answers_disabled_it_does_not(engine_for, plugins_config, expected):
    pm = get_plugin_manager(Settings(plugins=plugins_config), entrypoints=False, plugins=[strata_quirks_llama_cpp])
    assert first_result(pm, "engine_verdict", op="save", error=None, engine=engine_for(), held_tokens=0,
                        service=SimpleNamespace(state={})) == expected


def test_the_limit_comes_from_the_settings(engine_for):
    settings = Settings(plugins={"quirks_llama_cpp": {"unreused_restores_limit": 1}})
    pm = get_plugin_manager(settings, entrypoints=False, plugins=[strata_auto_sessions, strata_quirks_llama_cpp])
    engine = engine_for()
    service = SimpleNamespace(settings=settings, engine=engine, state={},
                              plugin_config=lambda name, model: settings.plugin_config(name, model))
    strata_quirks_llama_cpp.on_startup(service=service)
    assert first_result(pm, "auto_sessions_restore_unused", restored=900, reused=3, prompt_tokens=950,
                        engine=engine, service=service) == Verdict.UNSUPPORTED


@pytest.mark.parametrize("section, message", [
    ({"unreused_restores_limit": 0}, r"plugins\.quirks_llama_cpp\.unreused_restores_limit"),
    ({"unreused_restore_limit": 3}, r"plugins\.quirks_llama_cpp\.unreused_restore_limit: unknown key"),
])
def test_bad_settings_are_refused(section, message):
    with pytest.raises(ConfigError, match=message):
        get_plugin_manager(Settings(plugins={"quirks_llama_cpp": section}), entrypoints=False,
                           plugins=[strata_quirks_llama_cpp])


def test_it_loads_without_auto_sessions_and_answers_auto_sessions_own_question(engine_for):
    """The unused-restore rule is asked through auto-sessions' hook, never through the core's."""
    alone = get_plugin_manager(Settings(), entrypoints=False, plugins=[strata_quirks_llama_cpp])
    assert "quirks_llama_cpp" in {name for name, _ in alone.list_name_plugin()}
    with_parking = get_plugin_manager(Settings(), entrypoints=False,
                                      plugins=[strata_auto_sessions, strata_quirks_llama_cpp])
    caller = with_parking.hook.auto_sessions_restore_unused
    assert caller.spec is not None and caller.spec.namespace is strata_auto_sessions.hookspecs
    assert [impl.plugin_name for impl in caller.get_hookimpls()] == ["quirks_llama_cpp"]
    engine = engine_for()
    for _ in range(2):  # the engine_verdict hook has no opinion on it any more
        assert verdict(engine, "restore_reuse", EngineError(op="restore_reuse", message="not reused")) is None
    assert unused(engine) is None, "the engine_verdict calls counted nothing"
