"""Server settings: the engine's EngineArgs plus the server's own, from flags or the environment.

Both sources are derived from the dataclass fields, so a new EngineArgs field is a
new `--flag` and a new `TRILLM_FLAG` variable without touching this module. The
environment path exists for launches where we do not own the command line:
`hypercorn --worker-class trio 'trillm.http.app:create_app()'`.
"""
from __future__ import annotations

import argparse
import enum
import json
import os
import types
import typing
from dataclasses import dataclass, field, fields, replace

from trillm.config import EngineArgs

ENV_PREFIX = "TRILLM_"
# `trillm serve` reads the key from here when --api-key is not given: a command line is
# readable by every local user (/proc/*/cmdline), a process's environment only by its own.
API_KEY_VARIABLE = ENV_PREFIX + "API_KEY"
LIST_FLAGS = {"lora_modules"}  # flags that take several items (stored comma-separated)
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
# Where prometheus_client's multiprocess mode keeps every process's counts, read when it is first
# imported: set for several fronts (trillm/launch/fronts.py), whose /metrics sum them.
METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


class RouterPolicy(enum.StrEnum):
    """How the data-parallel router picks a replica (`--router-policy`, vllm-router's names)."""

    CACHE_AWARE = "cache_aware"  # by the longest prefix it routed there, unless the load is uneven
    KV_AWARE = "kv_aware"  # by the blocks the replicas' KV-cache events say they cache
    ROUND_ROBIN = "round_robin"
    POWER_OF_TWO = "power_of_two"  # the less loaded of two random replicas
    RANDOM = "random"


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the bound address is logged)
    api_key: str | None = None  # when set, all but liveness and schema routes need "Authorization: Bearer <key>"
    max_waiting: int = 1024  # requests waiting for the engine beyond this get 429
    backlog: int = 2048  # connections the kernel queues before we accept them (Hypercorn's 100 resets bursts)
    max_body_bytes: int = 8 << 20  # larger request bodies get 413 (a prompt of 8192 token ids is ~60 KB)
    served_model_name: str | None = None  # None: the model's name
    drain_timeout: float = 30.0  # on SIGTERM/SIGINT: seconds within which the process is gone
    log_level: str = "info"
    tool_call_parser: str | None = None  # hermes | llama3_json | none (auto refused); unset: the template's
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: <think>...</think> -> reasoning_content
    trust_request_chat_template: bool = False  # let requests bring their own chat_template (code we run)
    normalize_embeddings: bool = True  # /v1/embeddings vectors L2-normalised (off: as pooled)
    ui: bool = True  # the chat page at / (trillm/http/chat_page.py); --no-ui leaves it out
    responses_store_size: int = 1024  # /v1/responses kept for GET and previous_response_id (LRU)
    # CORS, with vLLM's flags and defaults: lists as JSON ('["https://a.example"]') or comma-separated
    allowed_origins: str = "*"
    allowed_methods: str = "*"
    allowed_headers: str = "*"
    allow_credentials: bool = False
    # Without --api-key, the admin routes (trillm/http/auth.py) answer requests addressed to a
    # loopback name, the bound address or these host names (DNS rebinding), and browsers' only
    # from the server's own pages or these origins
    allowed_hosts: str = ""
    admin_origins: str = ""
    # Data parallelism (trillm/launch/data_parallel.py): this many engine replicas here, each its own
    # process with its own cores and KV cache, behind vllm-router on --host / --port (0: none
    # here, the router alone in front of --data-parallel-address's)
    data_parallel_size: int = 1
    router_policy: RouterPolicy = RouterPolicy.CACHE_AWARE
    # replicas on other machines (`trillm serve` there), as URLs, that the router also routes to
    data_parallel_address: str | None = None
    # the other replicas behind the same router, as URLs: this one relays the admin calls it gets
    # (adapters, aborts, the prefix cache, sleep, weights) to them (trillm/http/peer_relay.py);
    # the supervisor sets it for the replicas it starts
    data_parallel_peers: str | None = None
    metrics_prefix: str = "trillm"  # trillm | vllm: the name prefix of /metrics (vllm: what gateways read)
    # What a request may make the server read from disk (trillm/http/paths.py): each is off unless
    # asked for, and every path a request names must resolve inside `allowed_weights_dir`.
    enable_weight_updates: bool = False  # /update_weights_from_disk, /update_weights
    allow_runtime_lora: bool = False  # /v1/load_lora_adapter, /v1/unload_lora_adapter, lora_request.lora_path
    allowed_weights_dir: str | None = None
    max_lora_adapters: int = 64  # adapters registered at once: a load while serving past it is refused
    # the engine core in a process of its own (trillm/engine/core_process.py): its steps no longer
    # share the interpreter's lock with the event loop that frames and sends every token. None:
    # the default where it is measured (on a GPU: trillm.engine.core_process.faster_in_own_process)
    engine_process: bool | None = None
    # HTTP front processes on the one port (vLLM's --api-server-count), each a Trio app of its
    # own beside the engine's process (trillm/launch/fronts.py): more event loops to frame and
    # send tokens where one loop is what limits the served rate
    api_server_count: int = 1
    engine: EngineArgs = field(default_factory=EngineArgs)

    def __post_init__(self) -> None:
        self.router_policy = RouterPolicy(self.router_policy)  # its name as a string is taken too
        if self.api_key == "":  # every request that sends no key would match it
            raise ValueError("--api-key must not be empty; leave it out to serve without a key.")
        if self.data_parallel_size < 0 or (self.data_parallel_size == 0 and not self.data_parallel_address):
            raise ValueError("--data-parallel-size is the replicas to start here: at least 1, or 0 with "
                             "--data-parallel-address (the router alone, in front of replicas elsewhere).")
        if not 0 <= self.port <= 65535:
            raise ValueError("--port is a TCP port: 0 (any free one) to 65535.")
        for flag, value, least, what in (
            ("--api-server-count", self.api_server_count, 1, "the HTTP front processes"),
            ("--max-waiting", self.max_waiting, 0, "the requests that may wait for the engine"),
            ("--backlog", self.backlog, 1, "the connections the kernel queues"),
            ("--max-body-bytes", self.max_body_bytes, 1, "the largest request body taken"),
            ("--drain-timeout", self.drain_timeout, 0, "the seconds a stop may take"),
            ("--responses-store-size", self.responses_store_size, 0, "the responses kept"),
        ):
            if value < least:
                raise ValueError(f"{flag} is {what}: at least {least}.")
        if self.api_server_count > 1:
            # Each of these needs every front idle at once, or a state every front follows, which
            # only one front can give today.
            for refused, flag in ((self.engine_process is False, "--no-engine-process (the fronts share the "
                                   "engine's own process)"),
                                  (self.supervises, "data parallelism"),
                                  (self.engine.enable_sleep_mode, "--enable-sleep-mode"),
                                  (self.enable_weight_updates, "--enable-weight-updates")):
                if refused:
                    raise ValueError(f"--api-server-count above 1 cannot serve with {flag}.")

    @property
    def supervises(self) -> bool:
        """Whether `trillm serve` supervises replicas behind a router (trillm/launch/data_parallel.py)
        rather than serving itself."""
        return self.data_parallel_size != 1 or bool(self.data_parallel_address)

    @staticmethod
    def as_list(value: str) -> list[str]:
        """A list setting's items: a JSON list, or comma-separated."""
        text = value.strip()
        if text.startswith("["):
            items = json.loads(text)
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ValueError(f"expected a JSON list of strings, got {value!r}")
            return items
        return [item.strip() for item in text.split(",") if item.strip()]

    def redacted(self) -> dict:
        """Everything, for /server_info, with secrets replaced."""
        server = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "engine"}
        if server["api_key"] is not None:
            server["api_key"] = "<redacted>"
        return {**server, "engine": {f.name: getattr(self.engine, f.name) for f in fields(self.engine)}}


def _settable(cls) -> list:
    hints = typing.get_type_hints(cls)
    return [(f.name, _scalar_type(hints[f.name]), f.default) for f in fields(cls) if f.name != "engine"]


def _scalar_type(hint) -> type:
    """`int | None` -> int; the converter a flag or variable uses."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    assert hint in (str, int, float, bool) or issubclass(hint, enum.StrEnum), f"no converter for {hint}"
    return hint


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE | _FALSE:
        raise ValueError(f"expected a boolean, got {text!r}")
    return value in _TRUE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of ServerSettings and EngineArgs: `max_num_seqs` -> `--max-num-seqs`."""
    for group_name, cls in (("server", ServerSettings), ("engine", EngineArgs)):
        group = parser.add_argument_group(group_name)
        for name, kind, default in _settable(cls):
            flag = "--" + name.replace("_", "-")
            if kind is bool:
                group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default)
            elif name in LIST_FLAGS:  # vLLM's `--lora-modules a=/p b=/q`: the items joined by commas
                group.add_argument(flag, dest=name, nargs="+", action=_JoinItems, default=default, metavar="ITEM")
            elif issubclass(kind, enum.StrEnum):  # by value, so a refusal lists the choices
                group.add_argument(flag, dest=name, default=default, choices=[member.value for member in kind],
                                   help="default: %(default)s")
            else:
                group.add_argument(
                    flag, dest=name, type=kind, default=default, metavar=kind.__name__.upper(),
                    help="default: %(default)s",
                )


class _JoinItems(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, ",".join(values))


def from_args(namespace: argparse.Namespace) -> ServerSettings:
    values = dict(vars(namespace))
    if values.get("api_key") is None:
        values["api_key"] = os.environ.get(API_KEY_VARIABLE) or None
    engine = EngineArgs(**{name: values[name] for name in EngineArgs.field_names()})
    return ServerSettings(**{name: values[name] for name, _, _ in _settable(ServerSettings)}, engine=engine)


def to_argv(settings: ServerSettings) -> list[str]:
    """The `trillm serve` flags that make `settings` again (from_args's inverse)."""
    argv = []
    for obj, cls in ((settings, ServerSettings), (settings.engine, EngineArgs)):
        for name, kind, _ in _settable(cls):
            value, flag = getattr(obj, name), "--" + name.replace("_", "-")
            if kind is bool and value is not None:
                argv.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                argv += [flag, str(value)]
    return argv


def from_env(environ=os.environ) -> ServerSettings:
    """Settings from TRILLM_<FIELD> variables (e.g. TRILLM_MODEL, TRILLM_API_KEY, TRILLM_MAX_NUM_SEQS)."""

    def read(cls, base):
        changes = {}
        for name, kind, _ in _settable(cls):
            text = environ.get(ENV_PREFIX + name.upper())
            if text is not None:
                changes[name] = _parse_bool(text) if kind is bool else kind(text)
        return replace(base, **changes)

    settings = read(ServerSettings, ServerSettings())
    return replace(settings, engine=read(EngineArgs, EngineArgs()))
