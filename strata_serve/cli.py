"""``strata-serve run | plugins | models | demo-model``, and the commands plugins add."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable

import click
from aiohttp import web

from strata_serve.config import ConfigError, Settings, load_settings

log = logging.getLogger("strata_serve")


class _MalformedHttpFilter(logging.Filter):
    """One line, not a traceback, for bytes that are not HTTP at all.

    aiohttp answers those itself, before any route (400, in the OpenAI shape:
    :func:`strata_serve.api.errors.shape_protocol_errors`), and logs them as errors
    with a traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import BadHttpMessage

        from strata_serve.api.errors import aiohttp_reason

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage):
            record.msg = "[strata] refused a malformed HTTP request: %s"
            record.args = (aiohttp_reason(error),)
            record.exc_info = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    # aiohttp's access log is one line per request; ours already says what matters.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(_MalformedHttpFilter())


class _CommandsWithPlugins(click.Group):
    """The command group; plugins' commands (``register_commands``) join it the first time
    a command it does not know is looked up, or the commands are listed."""

    _plugins_asked = False

    def _ask_plugins(self) -> None:
        if not self._plugins_asked:
            self._plugins_asked = True
            from strata_serve.plugins import add_plugin_commands

            add_plugin_commands(self)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._ask_plugins()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            self._ask_plugins()
        return super().get_command(ctx, cmd_name)


@click.group(cls=_CommandsWithPlugins)
@click.version_option(package_name="strata-serve")
def cli() -> None:
    """strata-serve: an OpenAI-compatible server in front of llama.cpp's llama-server."""


def _overrides(**flags: Any) -> dict[str, Any]:
    """CLI flags as nested settings, leaving out the ones not given."""
    sections: dict[str, dict[str, Any]] = {"server": {}, "engine": {}}
    mapping = {
        "host": ("server", "host"),
        "port": ("server", "port"),
        "model": ("engine", "model"),
        "ctx_size": ("engine", "ctx_size"),
        "slot_save_path": ("engine", "slot_save_path"),
        "engine_url": ("engine", "url"),
        "engine_binary": ("engine", "binary"),
        "cache_ram": ("engine", "cache_ram_mib"),
    }
    for flag, value in flags.items():
        if value is not None and flag in mapping:
            section, key = mapping[flag]
            sections[section][key] = value
    return {name: values for name, values in sections.items() if values}


def _settings_or_exit(config: Path | None, **flags: Any) -> Settings:
    try:
        settings = load_settings(config, **_overrides(**flags))
    except ConfigError as exc:
        raise click.ClickException(f"configuration: {exc}") from None
    # --disable-plugin adds to STRATA_DISABLE_PLUGINS and the file's list, never replaces them.
    settings.disable_plugins = sorted(set(settings.disable_plugins) | set(flags.get("disable_plugin") or ()))
    return settings


config_option = click.option("--config", "config", type=click.Path(path_type=Path, dir_okay=False),
                             help="A TOML or JSON settings file.")
disable_option = click.option("--disable-plugin", multiple=True, metavar="NAME",
                              help="Turn a plugin off for this run (repeatable).")


@cli.command()
@config_option
@click.option("--model", type=click.Path(path_type=Path),
              help="GGUF model for the engine: a path, or the name of a packaged model (`strata-serve models`).")
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="Port to listen on (default 8080).")
@click.option("--ctx-size", type=int, help="Engine context size in tokens.")
@click.option("--slot-save-path", type=click.Path(path_type=Path), help="Directory for slot files.")
@click.option("--cache-ram", type=int, help="Engine RAM prompt cache in MiB (0 turns it off).")
@click.option("--engine-url", help="Attach to a running llama-server instead of starting one.")
@click.option("--engine-binary", type=click.Path(path_type=Path), help="The llama-server binary to start.")
@disable_option
@click.option("--log-level", default="INFO", show_default=True)
def run(config: Path | None, log_level: str, **flags: Any) -> None:
    """Start the engine and serve the OpenAI API in front of it."""
    setup_logging(log_level.upper())
    settings = _settings_or_exit(config, **flags)
    _resolve_model_or_exit(settings)
    from strata_serve.engine import EngineUnavailable

    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.server.event_loop)) as runner:
            runner.run(serve(settings))
    except ConfigError as exc:
        raise click.ClickException(f"configuration: {exc}") from None
    except EngineUnavailable as exc:
        raise click.ClickException(f"engine: {exc}") from None


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop for ``server.event_loop`` (None: asyncio's own).

    ``auto``: uvloop where it is installed, asyncio's own where not (Windows, or an install
    without it). Much of the layer's own work on a request is the loop's: its callbacks,
    tasks and socket calls, which uvloop runs in C.
    """
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "auto":
            return None
        raise click.ClickException("configuration: server.event_loop is uvloop, which is not installed: "
                                   "pip install uvloop (or server.event_loop = \"auto\")") from None
    return uvloop.new_event_loop


def _resolve_model_or_exit(settings: Settings) -> None:
    """A packaged model's name (``smollm2``) becomes its installed file."""
    from strata_serve.models import PACKAGED_MODELS, resolve_model

    if settings.engine.model is None and settings.engine.url is None:
        names = ", ".join(sorted(PACKAGED_MODELS))
        raise click.ClickException(
            f"configuration: engine.model: give the engine a model: --model PATH to a GGUF file, "
            f"or the name of a packaged model ({names}; see `strata-serve models`)"
        )
    try:
        settings.engine.model = resolve_model(settings.engine.model)
    except ConfigError as exc:
        raise click.ClickException(f"configuration: {exc}") from None


async def serve(settings: Settings) -> None:
    """Run until SIGINT/SIGTERM, then stop in order: listeners, drain, on_shutdown, engine.

    Each step of the stop is bounded (``server.shutdown_grace_s``, ``server.shutdown_save_s``);
    a second signal stops at once.
    """
    from strata_serve.api import SERVICE, create_app
    from strata_serve.plugins import get_plugin_manager

    pm = get_plugin_manager(settings)
    app = create_app(settings, pm)
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True,
                           access_log=None, shutdown_timeout=settings.server.shutdown_grace_s + 15)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await runner.setup()  # starts the engine (cleanup_ctx)
    try:
        site = web.TCPSite(runner, settings.server.host, settings.server.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        log.info("[strata] listening on http://%s:%d (plugins: %s; event loop: %s)", host, port,
                 ", ".join(sorted(name for name, p in pm.list_name_plugin() if p is not None)),
                 "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio")
        log.info(
            "[strata] try: curl http://%s:%d/v1/chat/completions -H 'Content-Type: application/json' "
            "-d '{\"messages\":[{\"role\":\"user\","
            "\"content\":\"What is the capital of France? Answer in one sentence.\"}],"
            "\"max_tokens\":64,\"temperature\":0}'",
            host, port,
        )
        await stop.wait()
        # A second signal stops now: what still runs is cut off, the engine killed.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, app[SERVICE].stop_now)
        log.info("[strata] stopping: finishing the request in flight, then saving and stopping the engine "
                 "(a second Ctrl-C or SIGTERM stops at once)")
    finally:
        await runner.cleanup()
    log.info("[strata] stopped")


@cli.command("plugins")
@config_option
@disable_option
def plugins_command(config: Path | None, disable_plugin: tuple[str, ...]) -> None:
    """List the plugins: name, distribution, version, hooks, enabled."""
    from strata_serve.plugins import list_plugins

    settings = _settings_or_exit(config, disable_plugin=disable_plugin)
    try:
        infos = list_plugins(settings)
    except ConfigError as exc:
        raise click.ClickException(f"configuration: {exc}") from None
    rows = [("NAME", "DISTRIBUTION", "VERSION", "ENABLED", "HOOKS")]
    rows += [(i.name, i.distribution or "-", i.version or "-", "yes" if i.enabled else "no",
              ", ".join(i.hooks) or "-") for i in infos]
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    for row in rows:
        click.echo("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row[:4])) + "  " + row[4])


@cli.command("models")
def models_command() -> None:
    """List the packaged models `--model NAME` accepts, and where each is installed."""
    from strata_serve.models import PACKAGED_MODELS, packaged_model_path

    for model in PACKAGED_MODELS.values():
        path = packaged_model_path(model.name)
        click.echo(f"{model.name}  {model.description}; context {model.n_ctx:,} tokens")
        click.echo(f"  {path}" if path is not None else f"  not installed: {model.install}")


@cli.command("demo-model")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--size", type=click.Choice(["tiny", "bench", "quant"]), default="tiny", show_default=True)
@click.option("--force", is_flag=True, help="Write even if the file exists.")
def demo_model(path: Path, size: str, force: bool) -> None:
    """Write a small random-weight GGUF model (meaningless text; for tests and demos)."""
    try:
        from strata_serve.demo_model import write_demo_model
    except ImportError as exc:
        raise click.ClickException(f"demo models need the demo extra ({exc.name} is missing): "
                                   "pip install 'strata-serve[demo]'") from None

    if path.exists() and not force:
        click.echo(f"{path} exists; keeping it (--force to rewrite)")
        return
    written = write_demo_model(path, size=size)
    click.echo(f"wrote {written} ({written.stat().st_size:,} bytes, {size}). "
               "Its weights are random: the text it writes is meaningless. Use a real GGUF for real work.")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
