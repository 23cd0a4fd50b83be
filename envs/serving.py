"""The serving side of an environment: any OpenEnv ``Environment`` under OpenEnv's own ``create_app`` and uvicorn.

``EnvServer(cfg, replica_id)`` resolves ``env.impl`` (a built-in short name from ``BUILTIN_ENVS``, else
``module:Class``) to an OpenEnv ``Environment`` subclass, builds OpenEnv's FastAPI app for it
(``create_app(env, Action, Observation, max_concurrent_envs=env.capacity)``: one environment instance per WebSocket
session at ``/ws``, plus its HTTP routes) and serves it with uvicorn on ``env.host:env.port`` (0 = a free port) in
the replica's own event loop. The role (``services/env_replica.py``) registers the address it serves at.

What the replica adds around OpenEnv's app, and why:

* *The text fields.* A generator speaks text. ``action_field`` is the Action model's field named ``text``, else its
  only ``str`` field: a step sends ``{action_field: <the model's text>}``. ``observation_field`` likewise on the
  Observation model (``text``, else its only ``str`` field; none: the observation's fields as JSON). Both travel
  in the replica's beat (``meta``), so routers need no copy of the environment's code.
* *Rejections.* OpenEnv 0.3.0 answers a step whose Action does not validate with an error it cannot serialise
  when a validator raised ``ValueError`` (its error details keep the exception object), and then drops the whole
  session. The replica serves a subclass of the Action model whose validation turns any failure into an
  execution error with the message ``action_rejected: <reason>``; a ``step`` that raises ``envs.api.ActionRejected``
  is reported the same way. The router raises ``ActionRejected`` for them and ``EnvStepFailed`` for any other
  execution error (``envs/routing.py``).
* *Load and the session log.* An ASGI wrapper counts the live ``/ws`` sessions (the load in the replica's beats)
  and, with ``env.session_log``, logs every reset and step: ``session <n> <type> episode=<id>`` (the episode id is
  the one its reset named), which is how a test checks from the replica's own log that a session stayed on it.
* *Signals.* uvicorn's ``Server.serve`` installs its own SIGINT/SIGTERM handlers; the replica's process runner
  (``runtime/lifecycle.py``) owns them instead, so the server's are left out and the role stops it when told.

OpenEnv's server keeps its own rules: more sessions than ``env.capacity`` are refused (``CAPACITY_REACHED``), and
a capacity above 1 needs the environment class to say ``SUPPORTS_CONCURRENT_SESSIONS = True`` (each session gets
its own instance; a sync ``reset``/``step`` runs in that session's thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import typing
from collections import Counter
from collections.abc import Generator
from typing import Any

import orjson

from envs.api import ActionRejected
from envs.config import BUILTIN_ENVS, EnvConfig
from runtime.plugins import load_object
from topics.errors import ConfigError

log = logging.getLogger("streamforge.env")
session_log = logging.getLogger("streamforge.env.sessions")

REJECTED_PREFIX = "action_rejected: "  # the message prefix of an execution error that is a rejection
_PEEK_CHARS = 65536  # a message longer than this is not parsed for the session log
_RESERVED_OBSERVATION_FIELDS = ("done", "reward", "metadata")


class Rejected(Exception):
    """Raised inside the replica for a rejected action; OpenEnv sends ``str(self)`` as the error message."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{REJECTED_PREFIX}{reason}")


def resolve_env(impl: str) -> type:
    """The OpenEnv ``Environment`` subclass ``impl`` names; ``ConfigError`` naming ``env.impl`` otherwise."""
    if not impl:
        raise ConfigError("env.impl", "name the environment: a built-in name or 'module:Class'")
    cls = load_object(BUILTIN_ENVS.get(impl, impl), config_key="env.impl")
    from openenv.core.env_server.interfaces import Environment

    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError("env.impl", f"{impl!r} is not a subclass of OpenEnv's Environment")
    return cls


def env_types(cls: type) -> tuple[type, type]:
    """The Action and Observation models of an environment class: its ``Environment[Action, Observation, State]``
    parameters, else the annotations of its ``step(self, action: Action) -> Observation``."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if typing.get_origin(base) is Environment and len(args) >= 2 and all(isinstance(a, type) for a in args[:2]):
                return args[0], args[1]
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:  # noqa: BLE001 - unresolvable annotations: say what to do below
        hints = {}
    action, observation = hints.get("action"), hints.get("return")
    if isinstance(action, type) and issubclass(action, Action) and isinstance(observation, type) \
            and issubclass(observation, Observation):
        return action, observation
    raise ConfigError("env.impl", f"cannot tell the Action and Observation models of {cls.__name__}: subclass "
                                  "Environment[MyAction, MyObservation, MyState] or annotate "
                                  "step(self, action: MyAction, ...) -> MyObservation")


def _is_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return bool(args) and all(isinstance(a, str) for a in args)
    return bool(args) and any(_is_str(a) for a in args if a is not type(None))  # Optional[str], Annotated[str, ...]


def text_field(model: type, *, skip: tuple[str, ...] = ("metadata",), required: bool) -> str:
    """The field of ``model`` (a pydantic model) that carries text: ``text``, else its only ``str`` field; "" if
    none (``required``: a ``ConfigError`` instead)."""
    fields = {name: f for name, f in model.model_fields.items() if name not in skip}
    if "text" in fields and _is_str(fields["text"].annotation):
        return "text"
    strings = [name for name, f in fields.items() if _is_str(f.annotation)]
    if len(strings) == 1:
        return strings[0]
    if required:
        raise ConfigError("env.impl", f"{model.__name__} needs a field `text: str` (or exactly one str field) for "
                                      f"the model's action; it has {strings or 'none'}")
    return ""


def serving_classes(env_cls: type, action_cls: type) -> tuple[type, type]:
    """The environment and Action classes the replica serves: the user's, whose rejections become ``Rejected``
    (module docstring). The environment subclass keeps its class attributes (concurrency flags) and wraps
    ``step_async`` only where the class overrides it (OpenEnv calls an overridden one on the event loop)."""
    from openenv.core.env_server.interfaces import Environment
    from pydantic import ValidationError

    def model_validate(cls: type, obj: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return action_cls.model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_context=False)[0] if exc.error_count() else {}
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise Rejected(f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg"))) from None
        except ActionRejected as exc:
            raise Rejected(str(exc)) from None

    checked_action = type(f"{action_cls.__name__}Checked", (action_cls,),
                          {"__module__": __name__, "model_validate": classmethod(model_validate)})

    def step(self: Any, action: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return env_cls.step(self, action, *args, **kwargs)
        except ActionRejected as exc:
            raise Rejected(str(exc)) from None

    members: dict[str, Any] = {"__module__": __name__, "step": step}
    if env_cls.step_async is not Environment.step_async:
        async def step_async(self: Any, action: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await env_cls.step_async(self, action, *args, **kwargs)
            except ActionRejected as exc:
                raise Rejected(str(exc)) from None

        members["step_async"] = step_async
    return type(env_cls.__name__, (env_cls,), members), checked_action


class SessionCounter:
    """ASGI wrapper around OpenEnv's app: counts the live ``/ws`` sessions and what they send (module docstring)."""

    def __init__(self, app: Any, *, replica_id: str, log_sessions: bool) -> None:
        self.app, self.replica_id, self.log_sessions = app, replica_id, log_sessions
        self.live = 0
        self.opened = 0
        self.messages: Counter[str] = Counter()
        self.idle = asyncio.Event()  # set while no session is live
        self.idle.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "websocket" or scope.get("path") != "/ws":
            await self.app(scope, receive, send)
            return
        self.live += 1
        self.opened += 1
        self.idle.clear()
        session, episode = self.opened, ""

        async def counted_receive() -> dict[str, Any]:
            nonlocal episode
            message = await receive()
            if message.get("type") == "websocket.receive":
                kind, named = _peek(message.get("text") or message.get("bytes") or "")
                self.messages[kind] += 1
                if kind == "reset":
                    episode = named
                if self.log_sessions:
                    session_log.info("replica %s session %d %s episode=%s", self.replica_id, session, kind, episode)
            return message

        from starlette.websockets import WebSocketDisconnect

        try:
            await self.app(scope, counted_receive, send)
        except WebSocketDisconnect:
            # the client closed first: OpenEnv's endpoint then closes a socket that is gone and raises; nothing was
            # lost (the session ended), and uvicorn would log a traceback for every episode
            pass
        finally:
            self.live -= 1
            if self.live == 0:
                self.idle.set()


def _peek(raw: str | bytes) -> tuple[str, str]:
    """``(message type, episode id of a reset)`` of a client message, without trusting it."""
    if len(raw) > _PEEK_CHARS:
        return "oversized", ""
    try:
        msg = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "invalid", ""
    if not isinstance(msg, dict):
        return "invalid", ""
    kind = msg.get("type") if isinstance(msg.get("type"), str) and len(msg["type"]) <= 16 else "invalid"
    data = msg.get("data")
    episode = data.get("episode_id") if kind == "reset" and isinstance(data, dict) else ""
    return kind, episode if isinstance(episode, str) else ""


def _uvicorn_server(config: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its signal handlers; ``ready`` is set once it listens."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.ready = asyncio.Event()

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield  # the role's process runner owns SIGINT and SIGTERM

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            self.ready.set()

    return Server(config)


class EnvServer:
    """One replica's HTTP/WebSocket server (module docstring). ``start()`` builds the app and listens;
    ``serve()`` runs until ``stop()`` (it returning earlier is a crash); ``live_sessions`` is its load."""

    def __init__(self, cfg: EnvConfig, *, replica_id: str) -> None:
        self.cfg, self.replica_id = cfg, replica_id
        env_cls = resolve_env(cfg.impl)
        action_cls, observation_cls = env_types(env_cls)
        self.env_cls = env_cls
        self.action_field = text_field(action_cls, required=True)
        self.observation_field = text_field(observation_cls, skip=_RESERVED_OBSERVATION_FIELDS, required=False)
        served_env, served_action = serving_classes(env_cls, action_cls)
        from openenv.core.env_server.exceptions import ConcurrencyConfigurationError
        from openenv.core.env_server.http_server import create_app

        try:
            app = create_app(served_env, served_action, observation_cls, env_name=cfg.name,
                             max_concurrent_envs=cfg.capacity)
        except ConcurrencyConfigurationError as exc:
            raise ConfigError("env.capacity", f"{exc} (or set env.capacity: 1)") from exc
        self.sessions = SessionCounter(app, replica_id=replica_id, log_sessions=cfg.session_log)
        self._server: Any = None
        self._socket: socket.socket | None = None
        self._task: asyncio.Task | None = None

    @property
    def live_sessions(self) -> int:
        return self.sessions.live

    @property
    def port(self) -> int:
        assert self._socket is not None, "start() first"
        return int(self._socket.getsockname()[1])

    @property
    def address(self) -> str:
        """``ws://host:port`` (the WebSocket endpoint is ``<address>/ws``)."""
        return f"ws://{self.cfg.host}:{self.port}"

    @property
    def meta(self) -> dict[str, Any]:
        """What routers need to speak to this replica (its beat's ``meta``)."""
        return {"action_field": self.action_field, "observation_field": self.observation_field,
                "env_class": f"{self.env_cls.__module__}:{self.env_cls.__qualname__}"}

    async def start(self) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.cfg.host, self.cfg.port))
        except OSError as exc:
            sock.close()
            raise ConfigError("env.port", f"cannot listen on {self.cfg.host}:{self.cfg.port}: {exc}") from exc
        sock.listen(128)
        sock.setblocking(False)
        self._socket = sock
        config = uvicorn.Config(self.sessions, log_level="warning", lifespan="on", access_log=False,
                                ws_ping_interval=self.cfg.heartbeat_s,  # a dead caller's session is reclaimed
                                ws_ping_timeout=self.cfg.health_timeout_s,
                                ws_max_size=max(16 << 20, 8 * self.cfg.max_action_chars))
        self._server = _uvicorn_server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        ready = asyncio.ensure_future(self._server.ready.wait())
        await asyncio.wait([ready, self._task], return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if self._task.done():
            self._task.result()
            raise RuntimeError("the environment's server stopped while starting")
        log.info("replica %s of %s (%s) serves at %s/ws, capacity %d", self.replica_id, self.cfg.name,
                 self.cfg.impl, self.address, self.cfg.capacity)

    async def serve(self) -> None:
        """Waits on the server task; returns when the server has stopped (a crash unless the role is stopping)."""
        assert self._task is not None, "start() first"
        await asyncio.shield(self._task)

    async def wait_idle(self) -> None:
        """Wait until no session is live (sessions end on their callers' time: bound it)."""
        await self.sessions.idle.wait()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and every session (the callers see their sessions end); idempotent."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._task is not None:
            done, _ = await asyncio.wait([self._task], timeout=timeout_s)
            if not done:
                self._server.force_exit = True
                await asyncio.wait([self._task], timeout=timeout_s)
        if self._socket is not None:
            self._socket.close()
        self._server = None
