"""Run the server in the background of a notebook or a test, or in the foreground (`agl-lab serve`).

    with EmbeddedServer(key="k", default_proxy={"model_name": "tiny"}) as server:
        server.url        # http://127.0.0.1:PORT   (a free loopback port unless `port=` is given)
        server.store      # the same Store the routes use: read it directly from the notebook
        ...

uvicorn runs `serve()` on its own event loop in a daemon thread, so it works when the main
thread already runs a loop (Jupyter) and installs no signal handlers (uvicorn only does that
on the main thread). The socket is bound before the thread starts, so the port is known and
free-port races are impossible; start-up waits for `/healthz`.

`ThreadedUvicorn` is the reusable part (any ASGI app on a loopback port in a thread); the fake
OpenAI upstream of the tests and benchmarks runs on it too.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import ssl
import threading
import time
import typing
from collections.abc import Mapping
from typing import Any

import httpx
import uvicorn
from uvicorn.config import STARTUP_FAILURE

from agl_lab.addresses import ENGINE_KEY_ENV, advertised_host, is_loopback, url_host
from agl_lab.client import server_key
from agl_lab.keys import checked_key, key_source, warn_if_shared
from agl_lab.server.app import create_app
from agl_lab.server.asgi import HTTP_PROTOCOL, HandshakeBoundServer, http_protocol, read_limits
from agl_lab.server.backends import open_store
from agl_lab.server.config import LIMITS, ServerConfig, limit_help, load_server_config
from agl_lab.server.store import Store, StoreError

logger = logging.getLogger("agl_lab.server")
RUNNER_KEY_ENV = "AGL_RUNNER_KEY"  # agl-lab serve's runner_key (a runner host holds it as its AGL_KEY)


class ThreadedUvicorn:
    """Serve an ASGI app with uvicorn in a daemon thread on an already-bound socket."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_level: str = "warning",
        health_path: str | None = None,
        start_timeout: float = 20.0,
        http: Any = HTTP_PROTOCOL,
    ):
        self.app, self.host = app, host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that declare it,
        # and without it every response waits ~40 ms for a delayed ACK (Nagle).
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        # log_config=None: leave the host program's (notebook's) logging configuration alone
        config = uvicorn.Config(
            app,
            log_level=log_level,
            log_config=None,
            timeout_keep_alive=120,
            lifespan="on",
            access_log=False,
            http=http,
        )
        self._server = uvicorn.Server(config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)
        self._thread.start()
        self._wait_started(health_path, start_timeout)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])  # uvicorn's loop choice: uvloop when installed
        except BaseException as exc:  # surfaced by _wait_started / stop
            self._error = exc

    def _wait_started(self, health_path: str | None, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server on {self.url} did not start within {timeout:.0f}s") from self._error
            time.sleep(0.005)
        if health_path is None:
            return
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:  # started: the lifespan ran and the socket listens; /healthz: requests are served
                try:
                    if client.get(self.url + health_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.url}{health_path} did not answer 200 within {timeout:.0f}s")
                time.sleep(0.01)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit, wait for the thread, close the socket. Idempotent."""
        self._server.should_exit = True
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._sock.close()


class EmbeddedServer:
    """The agl_lab server (store + API + gateway) in a background thread.

    `EmbeddedServer(config=None, *, store=None, rewriters=(), **overrides)`: `overrides` are
    ServerConfig keys (nested mappings such as `default_proxy={"model_name": ...}` are merged
    key by key). The port is free unless `port` is given (as an override or a set config field).
    `store` is a Store object to share, or a store URL (the `store` config key). A store opened
    here is closed by `stop()`; a passed-in Store object is not.
    """

    def __init__(
        self,
        config: ServerConfig | Mapping[str, Any] | None = None,
        *,
        store: Store | str | None = None,
        rewriters: tuple[Any, ...] | list[Any] = (),
        log_level: str = "warning",
        advertise_host: str | None = None,
        **overrides: Any,
    ):
        if isinstance(store, str):
            overrides["store"], store = store, None
        base = load_server_config(config if config is not None else {})
        port_given = "port" in overrides or "port" in base.model_fields_set
        merged = _deep_merge(base.model_dump(exclude_unset=True), overrides)
        self.config: ServerConfig = load_server_config(merged)
        self._owns_store = store is None
        self.store: Store = (
            store
            if store is not None
            else open_store(
                self.config.store,
                terminal_log_limit=self.config.terminal_log_limit,
                timeout_seconds=self.config.store_timeout_seconds,
            )
        )
        self.app = create_app(self.config, store=self.store, rewriters=rewriters)
        try:
            self._uvicorn = ThreadedUvicorn(
                self.app,
                self.config.host,
                self.config.port if port_given else 0,
                log_level=log_level,
                health_path="/healthz",
                http=http_protocol(read_limits(self.config)),
            )
        except BaseException:
            if self._owns_store:
                self.store.close()
            raise
        self.config = self.config.model_copy(update={"port": self._uvicorn.port})
        # the host `url` names (agl_lab/addresses.py): the bind host unless a wildcard or `advertise_host`
        self.advertise_host = advertised_host(self.config.host, advertise_host)
        self._stopped = False

    @property
    def url(self) -> str:
        """`http://HOST:PORT` with the advertised host: what runners and agents are given."""
        return f"http://{url_host(self.advertise_host)}:{self._uvicorn.port}"

    @property
    def headers(self) -> dict[str, str]:
        """Auth headers for this server ({} when no key is set)."""
        return {"Authorization": f"Bearer {self.config.key}"} if self.config.key else {}

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway

    def set_tokenizer(self, model_name: str, tokenizer: Any) -> None:
        """Give the token-preserving mode the tokenizer (with chat template) of `model_name`."""
        set_tokenizer(self.gateway, model_name, tokenizer)

    def stop(self) -> None:
        """Stop serving and close the store this server opened. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._uvicorn.stop()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"EmbeddedServer({self.url}, store={self.store!r}, {state})"


def set_tokenizer(gateway: Any, model_name: str, tokenizer: Any) -> None:
    """Register `tokenizer` with every gateway rewriter that takes one (the token-preserving mode)."""
    takers = [r for r in gateway.rewriters if callable(getattr(r, "set_tokenizer", None))]
    if not takers:
        raise ValueError(
            "set_tokenizer: no rewriter of this server takes a tokenizer; start it with "
            "token_preserving=True (agl-lab serve --token-preserving)"
        )
    for rewriter in takers:
        rewriter.set_tokenizer(model_name, tokenizer)


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        elif hasattr(value, "model_dump"):
            out[key] = value.model_dump()
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# agl-lab serve
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agl-lab serve", description="Run the rollout store + LLM gateway.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--key",
        default=None,
        help="API key; prefer AGL_KEY or --key-file (ps shows arguments). None: auth off, loopback only",
    )
    p.add_argument("--key-file", default=None, metavar="PATH", help="read the API key from this file")
    p.add_argument(
        "--runner-key-file",
        default=None,
        metavar="PATH",
        help="runner_key: a key for runner hosts (default: AGL_RUNNER_KEY) that opens only claims, heartbeats, "
        "releases, PATCHes, events and agent tokens: no deletes, no model registration",
    )
    p.add_argument(
        "--engine-key-file",
        default=None,
        metavar="PATH",
        help="upstream_key: the key sent to the engines' OpenAI servers (default: AGL_ENGINE_KEY); "
        "an engine bound beyond loopback requires it",
    )
    p.add_argument("--model-name", default=None, help="default_proxy.model_name: the model engines register")
    p.add_argument(
        "--store",
        default="memory",
        help="'memory', 'sqlite:///path/to/store.db' (this server only) or "
        "'postgresql://user:pass@host:5432/db' (shared by several servers)",
    )
    p.add_argument("--train-temperature", type=float, default=None)
    p.add_argument("--val-temperature", type=float, default=None)
    p.add_argument("--no-log-probs", action="store_true", help="do not ask upstream for logprobs in train mode")
    p.add_argument("--token-preserving", action="store_true")
    p.add_argument(
        "--tokenizer-path", default=None, help="tokenizer (with chat template) of --model-name, for --token-preserving"
    )
    p.add_argument(
        "--upstream-client",
        default="auto",
        choices=typing.get_args(ServerConfig.model_fields["upstream_client"].annotation),
    )
    for flag, (key, kind, metavar, text) in LIMIT_FLAGS.items():
        p.add_argument(flag, dest=key, type=kind, default=None, metavar=metavar, help=f"{key}: {text}")
    p.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        default=None,
        metavar="NAME",
        help="allowed_hosts: without a key, also answer requests whose Host header is NAME "
        "(repeatable; '*' for any; default only localhost, 127.0.0.1, ::1)",
    )
    p.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="PEM",
        help="serve HTTPS with this certificate (chain); clients verify it with SSL_CERT_FILE=CA.pem",
    )
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the private key of --ssl-certfile")
    p.add_argument("--log-level", default="info", help="info (default): start-up, warnings, errors; debug: per request")
    p.add_argument("--access-log", action="store_true", help="log one line per request (default: only at debug)")
    return p


def tls_files(args: argparse.Namespace) -> dict[str, str]:
    """uvicorn's `ssl_certfile`/`ssl_keyfile` from --ssl-certfile/--ssl-keyfile ({}: plain HTTP).
    Both or neither, and they must load as a certificate and its key: SystemExit with one line
    naming the flag, the file and the problem otherwise (not uvicorn's traceback)."""
    cert, key = getattr(args, "ssl_certfile", None), getattr(args, "ssl_keyfile", None)
    if (cert is None) != (key is None):
        raise SystemExit("agl-lab serve: give --ssl-certfile and --ssl-keyfile together (the certificate and its key)")
    if cert is None:
        return {}
    for flag, path in (("--ssl-certfile", cert), ("--ssl-keyfile", key)):
        problem = _pem_file_problem(path)
        if problem is not None:
            raise SystemExit(f"agl-lab serve: {flag} {path} {problem}")
    try:
        ssl.create_default_context(cafile=cert)  # reads its certificates only
    except ssl.SSLError as exc:
        raise SystemExit(
            f"agl-lab serve: --ssl-certfile {cert} holds no PEM certificate ({exc.reason or exc}): "
            "give the server's certificate (chain) in PEM, '-----BEGIN CERTIFICATE-----' first"
        ) from None
    try:  # an encrypted key gets an empty password: refused here, never a prompt on the terminal
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise SystemExit(
                f"agl-lab serve: --ssl-keyfile {key} is not the private key of --ssl-certfile {cert} "
                "(key values mismatch): give the key the certificate was made for"
            ) from None
        raise SystemExit(
            f"agl-lab serve: --ssl-keyfile {key} holds no private key that loads "
            f"({exc.reason or 'no PEM private key found'}): give the certificate's private key in PEM, unencrypted"
        ) from None
    warn_if_shared(key, "--ssl-keyfile", "agl-lab serve")
    return {"ssl_certfile": cert, "ssl_keyfile": key}


def _pem_file_problem(path: str) -> str | None:
    """Why `path` cannot be a PEM file to load ("is a directory", ...), or None."""
    if os.path.isdir(path):
        return "is a directory: give the PEM file in it"
    if not os.access(path, os.R_OK) or not os.path.isfile(path):
        return "is not a readable file"
    if os.path.getsize(path) == 0:
        return "is empty: give a PEM file"
    return None


# `agl-lab serve` flags of the server's limits (server/config.py LIMITS), set only when given:
# flag -> (key, type, metavar, help)
LIMIT_FLAGS: dict[str, tuple[str, type, str, str]] = {
    field.json_schema_extra["flag"]: (key, field.annotation, "N" if field.annotation is int else "S", limit_help(key))
    for key, field in LIMITS.items()
}


def serve_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The ServerConfig of `agl-lab serve`'s parsed flags (errors name the config key).

    Without a key (no --key, --key-file or AGL_KEY) only a loopback address may be bound:
    anyone who can reach the port could otherwise drive the store and the gateway.
    """
    env = os.environ if environ is None else environ
    key = checked_key(server_key(args.key, args.key_file, env, "agl-lab serve"), key_source(args), "agl-lab serve")
    if not key and not is_loopback(args.host):
        raise SystemExit(
            f"agl-lab serve: refusing to bind {args.host} without a key: set AGL_KEY (or --key-file "
            "PATH) so clients must authenticate, or bind 127.0.0.1"
        )
    proxy: dict[str, Any] = {"include_log_probs": not args.no_log_probs}
    if args.model_name is not None:
        proxy["model_name"] = args.model_name
    if args.train_temperature is not None:
        proxy["train"] = {"temperature": args.train_temperature}
    if args.val_temperature is not None:
        proxy["val"] = {"temperature": args.val_temperature}
    upstream_key = _other_key(env, ENGINE_KEY_ENV, getattr(args, "engine_key_file", None), "--engine-key-file")
    runner_key = _other_key(env, RUNNER_KEY_ENV, getattr(args, "runner_key_file", None), "--runner-key-file")
    if runner_key and not key:
        raise SystemExit("agl-lab serve: a runner key needs the admin key too: set AGL_KEY (or --key-file)")
    raw: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "key": key,
        "upstream_key": upstream_key,
        "runner_key": runner_key,
        "store": args.store,
        "default_proxy": proxy,
        "token_preserving": args.token_preserving,
        "upstream_client": args.upstream_client,
    }
    raw.update({key: getattr(args, key) for key, *_ in LIMIT_FLAGS.values() if getattr(args, key) is not None})
    if getattr(args, "allowed_hosts", None):
        raw["allowed_hosts"] = [*ServerConfig().allowed_hosts, *args.allowed_hosts]
    return load_server_config(raw)


def _other_key(env: Mapping[str, str], env_name: str, path: str | None, flag: str) -> str:
    """The runner's or the engine's key: the content of `path` (`flag`), else $`env_name`; checked."""
    if not path:
        return checked_key(env.get(env_name, ""), env_name, "agl-lab serve")
    try:
        key = open(path, encoding="utf-8").read().strip()  # noqa: SIM115
    except OSError as exc:
        raise SystemExit(f"agl-lab serve: {flag} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SystemExit(f"agl-lab serve: {flag} {path} is not UTF-8 text: write the key (ASCII) into it") from None
    if not key:
        raise SystemExit(f"agl-lab serve: {flag} {path} is empty: write the key into it")
    return checked_key(key, f"{flag} {path}", "agl-lab serve")


def serve_main(argv: list[str]) -> int:
    """`agl-lab serve ...`: run the server in the foreground until interrupted."""
    args = _parser().parse_args(argv)
    try:
        config = serve_config(args)
    except ValueError as exc:  # a flag's value the config refuses: the message names the key
        raise SystemExit(f"agl-lab serve: {exc}") from None
    tls = tls_files(args)
    if args.tokenizer_path and not config.token_preserving:
        raise SystemExit("agl-lab serve: --tokenizer-path is only used with --token-preserving")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        store = open_store(
            config.store, terminal_log_limit=config.terminal_log_limit, timeout_seconds=config.store_timeout_seconds
        )
    except (StoreError, ValueError) as exc:  # locked file, unreachable database, bad URL: say which
        raise SystemExit(f"agl-lab serve: --store: {exc}") from None
    try:
        app = create_app(config, store=store)
        gc.collect()
        gc.freeze()  # start-up objects leave the collector's scans: shorter pauses of the event loop
        if args.tokenizer_path:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path, local_files_only=True)
            except (OSError, ValueError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise SystemExit(
                    f"agl-lab serve: --tokenizer-path {args.tokenizer_path}: no tokenizer loads from it ({first})"
                ) from None
            set_tokenizer(app.state.gateway, config.default_proxy.model_name, tokenizer)
        # one access-log line per request only when asked (--access-log) or at debug: at "info"
        # a busy gateway would log every agent call; uvicorn formats a line before filtering it
        access_log = args.access_log or args.log_level.lower() in ("trace", "debug")
        uv_config = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            workers=1,
            timeout_keep_alive=120,
            log_level=args.log_level,
            http=http_protocol(read_limits(config)),
            access_log=access_log,
            **tls,
        )
        server = HandshakeBoundServer(uv_config, handshake_timeout=config.header_timeout_seconds)
        try:  # what uvicorn.run does with one worker, with the server above
            server.run()
        except KeyboardInterrupt:
            pass
    finally:
        store.close()
    return 0 if server.started else STARTUP_FAILURE
