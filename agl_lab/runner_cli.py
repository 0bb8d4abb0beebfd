"""`agl-lab runner`: run agents for a server on another host (the `Runner`, as a process).

    agl-lab runner --server http://trainer-host:8080 --key KEY --agent my_agents:solve --concurrency 16
    agl-lab runner configs/my_run.yaml [key=value ...]     # the same from the trainer's config

With a config (the trainer's YAML and overrides), the defaults come from its keys, and a flag
wins over its key:

    --server       agentlightning.agl_base_url
    --key          agentlightning.agl_key
    --agent        agl_lab.agent, else the task's agent (agl_lab.task.name), else each rollout's
                   config.local.agent_class (agentlightning.local.agent_class)
    --concurrency  agl_lab.runner.concurrency
    --rollout-timeout  agl_lab.runner.agent_timeout_seconds

The process claims queued rollouts from the server (`POST /api/rollouts/claim`: each rollout
goes to exactly one runner, however many share the server), runs `--agent` for each, renews
their leases, and prints one line per `--summary-every` finished rollouts plus one on exit.
SIGTERM or Ctrl-C stops it cleanly: its agents are killed and their rollouts *released* back
to the queue, where another runner picks them up as their next attempt (nothing is failed;
`Runner.stop`). A runner killed with SIGKILL releases nothing: the server re-queues its
rollouts when their lease runs out (`lease_seconds`, up to `max_attempts`).

`--key-file` takes the runner key of `agl-lab serve --runner-key-file` (claims, heartbeats,
events and agent tokens only) as well as the admin key; `--ssl-ca-file CA.pem` verifies an
https:// server (it sets SSL_CERT_FILE for the runner and its agents); `--metrics-port N` serves
the runner's counters as Prometheus text (`agl_runner_*`, docs/many-machines.md).

`--ray [ADDRESS]` runs each agent as a Ray task spread over a cluster's nodes (`agl_lab.ray_runner`;
Ray is imported only then); the claims, heartbeats and attempts stay in this process. A HOST:PORT
where no Ray head accepts a connection within `--ray-connect-timeout` (30 s) is one line, exit 2;
so is a `--server` that is no agl server (http:// on a TLS port, https:// on a plain one, a web page).

The trainer whose rollouts these runners execute starts no runner of its own:
`agl_lab.runner.enabled=false` (and, with an external server, `agl_lab.server.embedded=false`
with `agentlightning.agl_base_url` naming it). docs/robustness.md describes leases and attempts.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

SUMMARY_EVERY = 50


def build_parser() -> argparse.ArgumentParser:
    """`agl-lab runner`'s flags.

    One piece: an argparse table, one flag after another; splitting it would only scatter the
    flags a reader looks up together."""
    p = argparse.ArgumentParser(prog="agl-lab runner", description="Claim and run rollouts of an agl-lab / AGL server.")
    p.add_argument("config", nargs="?", default=None, help="optional: the trainer's YAML config, for the defaults")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    p.add_argument(
        "--server",
        default=os.environ.get("AGL_SERVER_URL"),
        metavar="URL",
        help="the server's URL, e.g. http://trainer-host:8080 (default $AGL_SERVER_URL)",
    )
    p.add_argument("--key", default=None, help="the server's key (default: --key-file, else $AGL_KEY)")
    p.add_argument("--key-file", default=None, metavar="PATH", help="read the key from this file")
    p.add_argument(
        "--agent",
        default=None,
        metavar="module:function|module:Class",
        help="the agent: a function agent(task, ctx) run in a thread, or an Agent Lightning "
        "agent class run in a subprocess per rollout (default: each rollout's "
        "config.local.agent_class)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="most agents at once (default agl_lab.runner.concurrency, else 16)",
    )
    p.add_argument(
        "--agent-server-url",
        default=None,
        metavar="URL",
        help="the server URL put in the agents' URLs (default --server)",
    )
    p.add_argument(
        "--rollout-timeout", type=float, default=None, metavar="S", help="caps every rollout's config.timeout_seconds"
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=0.05,
        metavar="S",
        help="seconds between claims while slots are free (default 0.05)",
    )
    p.add_argument(
        "--runner-id",
        default=None,
        help="names this runner in the server's log and release messages (default host-pid-random)",
    )
    p.add_argument(
        "--summary-every",
        type=int,
        default=SUMMARY_EVERY,
        metavar="N",
        help=f"print a summary line every N finished rollouts (default {SUMMARY_EVERY}; 0: only on exit)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve GET /metrics (Prometheus text: agl_runner_*) on this port (0: a free one; default off)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="bind address of --metrics-port (default 127.0.0.1; the counters carry no secrets)",
    )
    p.add_argument(
        "--ssl-ca-file",
        default=None,
        metavar="PEM",
        help="verify an https:// server with this CA file (sets SSL_CERT_FILE for the runner and its agents)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run each agent as a Ray task spread over the cluster's nodes (ADDRESS: HOST:PORT of its head; "
        "bare: $RAY_ADDRESS, else the cluster on this host); claims and leases stay in this process",
    )
    p.add_argument(
        "--ray-cpus-per-agent",
        type=float,
        default=1.0,
        metavar="N",
        help="Ray CPUs each agent task reserves with --ray (default 1; 0.25: four agents per CPU)",
    )
    p.add_argument(
        "--ray-connect-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="with --ray HOST:PORT: give up (exit 2) when no Ray head accepts a connection there within S s (default 30)",
    )
    p.add_argument("--log-level", default="warning", help="log level of the runner's messages (default warning)")
    return p


def runner_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """--key, else --key-file's content, else $AGL_KEY, else "" (the same rule as `agl-lab serve`)."""
    from agl_lab.client import server_key
    from agl_lab.keys import checked_key, key_source

    return checked_key(
        server_key(args.key, args.key_file, environ, "agl-lab runner"), key_source(args), "agl-lab runner"
    )


def summary_line(stats: Mapping[str, int], wall: float, prefix: str = "agl-lab runner") -> str:
    """One line of what the runner did: finished rollouts, their outcomes, rate, what it holds."""
    done = stats["succeeded"] + stats["failed"]
    rate = done / wall if wall > 0 else 0.0
    extra = "".join(
        f" · {name} {stats[name]}" for name in ("released", "abandoned", "conflicts", "node_lost") if stats.get(name)
    )
    return (
        f"{prefix}: {done} done ({stats['succeeded']} succeeded, {stats['failed']} failed) in {wall:.1f} s "
        f"· {rate:.2f} rollouts/s · claimed {stats['claimed']} · running {stats['running']}{extra}"
    )


def runner_main(argv: list[str]) -> int:
    """`agl-lab runner --server URL [--key KEY] [--agent SPEC] [--concurrency N] ...`; see the module docstring."""
    args = build_parser().parse_intermixed_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        runner = _build_runner(args)
    except (ValueError, TypeError, ImportError, LookupError) as exc:  # ConfigError is a ValueError
        print(f"agl-lab runner: {exc}", file=sys.stderr)
        return 2
    if not _check_server(runner):
        return 2
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()
        signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once

    t0 = time.monotonic()
    try:
        runner.start()
    except (ConnectionError, RuntimeError, ValueError) as exc:  # --ray: no cluster at that address
        print(f"agl-lab runner: could not start: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):  # after start(): ray.init (--ray) installs its own
        signal.signal(sig, on_signal)
    metrics_server = None
    if args.metrics_port is not None:
        metrics_server = serve_metrics(runner, args.metrics_host, args.metrics_port)
        host, port = metrics_server.server_address[:2]
        print(f"agl-lab runner: metrics at http://{host}:{port}/metrics", flush=True)
    spec = getattr(runner.agent, "__module__", ""), getattr(runner.agent, "__qualname__", runner.agent)
    agent = (
        args.agent
        or (f"{spec[0]}:{spec[1]}" if callable(runner.agent) else runner.agent)
        or "each rollout's config.local.agent_class"
    )
    print(
        f"agl-lab runner {runner.runner_id}: claiming from {runner.server_url} · agent {agent} · "
        f"concurrency {runner.concurrency}"
        + (f" · agents as Ray tasks on {runner.address}" if getattr(runner, "address", None) else ""),
        flush=True,
    )
    printed = 0
    while not stop.wait(0.1):
        if runner.auth_error is not None:  # the key stopped working after start-up: bounded retries, then out
            runner.stop()
            print(f"agl-lab runner: {runner.auth_error}", file=sys.stderr, flush=True)
            return 2
        stats = runner.stats
        done = stats["succeeded"] + stats["failed"]
        if args.summary_every > 0 and done >= printed + args.summary_every:
            printed = done - done % args.summary_every
            print(summary_line(stats, time.monotonic() - t0), flush=True)
    runner.stop()
    if metrics_server is not None:
        metrics_server.shutdown()
    print(summary_line(runner.stats, time.monotonic() - t0, f"agl-lab runner: stopped ({received[0]})"), flush=True)
    return 0


def serve_metrics(runner: Any, host: str, port: int) -> Any:
    """A thread serving `GET /metrics` (the runner's counters, Prometheus text) on host:port."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from agl_lab.server.metrics import CONTENT_TYPE, render, runner_samples

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only GET /metrics is served here")
                return
            body = render(runner_samples(runner.stats)).encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # one line per scrape is noise
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="runner-metrics", daemon=True).start()
    return server


def _from_config(args: argparse.Namespace) -> None:
    """Fill the flags not given from the trainer's config (see the module docstring)."""
    if args.config is not None and "=" in args.config and not os.path.exists(args.config):
        args.overrides.insert(0, args.config)  # `agl-lab runner key=value`: no config file
        args.config = None
    if args.config is None and not args.overrides:
        return
    import warnings

    from agl_lab import config as config_mod
    from agl_lab.tasks import agent_and_task

    with warnings.catch_warnings():  # the training keys' warnings are the trainer's to print
        warnings.simplefilter("ignore", config_mod.ConfigWarning)
        cfg = config_mod.load_config(args.config, list(args.overrides))
    agl, lab = cfg.agentlightning, cfg.agl_lab
    args.server = args.server or (str(agl.agl_base_url) if agl.get("agl_base_url") else None)
    if args.key is None and args.key_file is None and agl.get("agl_key"):
        args.key, args.key_named = str(agl.agl_key), "agentlightning.agl_key"  # key_named: errors say where
    if args.agent is None:
        agent, _ = agent_and_task(cfg, None, None, has_tasks=True)
        args.agent_object = agent  # a function, a "module:Class" string, or None (config.local.agent_class)
    if args.concurrency is None:
        args.concurrency = int(lab.runner.concurrency)
    if args.rollout_timeout is None and lab.runner.get("agent_timeout_seconds") is not None:
        args.rollout_timeout = float(lab.runner.agent_timeout_seconds)


def _build_runner(args: argparse.Namespace):
    from agl_lab.agent import load_agent
    from agl_lab.runner import Runner

    _from_config(args)
    if not args.server:
        raise ValueError(
            "--server URL is required (the agl-lab serve / trainer server, e.g. http://host:8080), "
            "or set $AGL_SERVER_URL"
        )
    if not args.server.startswith(("http://", "https://")):
        raise ValueError(f"--server {args.server!r} must be an http:// or https:// URL")
    if args.ssl_ca_file is not None:
        _check_ca_file(args.ssl_ca_file)
        os.environ["SSL_CERT_FILE"] = args.ssl_ca_file  # httpx and the openai SDK (agents) read it
    if args.summary_every < 0:
        raise ValueError(f"--summary-every must be >= 0, got {args.summary_every}")
    if os.getcwd() not in sys.path:  # `module:function` imports from the current directory, as `python -m`
        sys.path.insert(0, os.getcwd())
    agent = load_agent(args.agent) if args.agent is not None else getattr(args, "agent_object", None)
    concurrency = 16 if args.concurrency is None else args.concurrency
    runner_class, ray_args = Runner, {}
    if args.ray is not None:  # Ray is imported only by RayRunner.start(): the plain runner stays light
        from agl_lab.ray_runner import RayRunner

        runner_class = RayRunner

        if not args.ray_cpus_per_agent >= 0:
            raise ValueError(f"--ray-cpus-per-agent must be >= 0, got {args.ray_cpus_per_agent}")
        if not args.ray_connect_timeout > 0:
            raise ValueError(f"--ray-connect-timeout must be > 0 seconds, got {args.ray_connect_timeout}")
        address = args.ray or os.environ.get("RAY_ADDRESS") or "auto"
        ray_args = {
            "address": address,
            "cpus_per_agent": args.ray_cpus_per_agent,
            "connect_timeout": args.ray_connect_timeout,
        }
    return runner_class(
        args.server,
        **ray_args,
        key=runner_key(args, os.environ),
        agent=agent,
        concurrency=concurrency,
        poll_interval=args.poll_interval,
        rollout_timeout_seconds=args.rollout_timeout,
        agent_server_url=args.agent_server_url,
        runner_id=args.runner_id,
    )


def _check_ca_file(path: str) -> None:
    """ValueError in one line when --ssl-ca-file `path` does not load as PEM certificates."""
    import ssl

    if os.path.isdir(path) or not os.access(path, os.R_OK):
        raise ValueError(f"--ssl-ca-file {path} is not a readable file")
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(
            f"--ssl-ca-file {path} holds no PEM certificate ({exc.reason or exc}): give the certificate of the CA "
            "that signed the server's, in PEM"
        ) from None


def _check_server(runner) -> bool:
    """Fail at once on a wrong key (401) and on an address that is no agl server this runner can use
    (`AglWrongServer`: the certificate, http:// vs https://, a web page); a server not up yet is
    waited for (the runner retries)."""
    from agl_lab.client import AglAuthError, AglClient, AglWrongServer

    try:
        with AglClient(runner.server_url, key=runner.key, timeout=10, max_retries=0) as client:
            client.list_rollouts(["queuing"], limit=0)
    except AglAuthError:
        print(
            f"agl-lab runner: {runner.server_url} rejected the key (401): pass the server's key with --key, "
            "--key-file or $AGL_KEY",
            file=sys.stderr,
        )
        return False
    except AglWrongServer as exc:  # the next try would meet the same server
        print(f"agl-lab runner: {exc}", file=sys.stderr)
        return False
    except Exception as exc:  # not up yet, or a hiccup: the poll loop keeps trying
        print(f"agl-lab runner: {runner.server_url} is not reachable yet ({exc!r:.200}); retrying", flush=True)
    return True
