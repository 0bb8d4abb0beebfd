"""Runner: turns queued rollouts into agent executions and reports how each one ended.

The runner is the local controller of Agent Lightning v1 (`runner_type=local`), made
usable from a notebook. A daemon thread polls the store, claims queued rollouts and runs
an agent for each; every rollout it claims ends `succeeded` or `failed` with an
`error_message` that says why. It records nothing else: model calls are captured by the
gateway, rewards are posted by the agent (or by the runner for a callable's return value).

The agent it runs is a callable `agent(task, ctx)` run in a thread of this process, or an AGL
agent class (`"module:Class"`) run in a subprocess per rollout: the contract, `AgentContext`
and the helpers that name and load agents are the agent-facing API in `agl_lab.agent`.

Lifecycle of one rollout

    queuing --POST /api/rollouts/claim--> running (attempt "0", "1", ...) --> succeeded | failed
       ^                                     |  lease expired (runner died) / released (runner stopped)
       +-------------------------------------+  -> the next claim is the next attempt

    An agl_lab server hands each queued rollout to exactly one runner per claim request; on an
    AGL server (no claim route: 404/405) the runner lists the queue and PATCHes
    running(last_attempt_id="0"), skipping the 409s of rollouts another runner took first
    (counted: `stats["conflicts"]`).

Design decisions
- One supervisor thread per claimed rollout decides the outcome exactly once (the first
  decision wins: agent finished, timeout, external termination or runner shutdown) and
  PATCHes it with retries, so slow server calls never delay other rollouts.
- A callable runs in its own daemon thread, not in a `ThreadPoolExecutor`: a hanging agent
  is abandoned at its timeout (its later gateway calls for the terminal rollout are refused
  by the gateway) and can neither hold a pool slot nor block interpreter exit.
- A subprocess agent runs in a new session; timeout, shutdown and completion kill its whole
  process group and every process that carries its `AGL_LAB_ROLLOUT_MARK` (daemons that left
  the group: `agl_lab.agent_procs`), so tool servers it started do not outlive it. The last
  2000 characters of its stderr are quoted in the error message of a failed rollout.
- The per-rollout timeout is `min(config.timeout_seconds, rollout_timeout_seconds)`.
- A rollout this runner runs that the store reports terminal or deleted (e.g. failed by a
  trainer's bounded wait) is stopped and its slot freed (checked about once a second).
- Every server call goes through one `AglClient` (`agl_lab.client`): the same request and
  retry code as the trainer's; idempotent calls are retried, claims are sent once.
- Everything the runner does for an attempt names it: the agent's URLs and token, the reward,
  the heartbeat and the terminal PATCH (`?attempt_id=`, applied only while that attempt runs).
  So a runner that lost its attempt (lease expired while it was partitioned) can neither end
  nor feed the next attempt, and learns from its heartbeat to stop the agent.
- Server hiccups are logged (throttled) and the poll loop keeps going; `stop()` is bounded
  and leaves no rollout of this runner in `running`: it releases them back to the queue
  (`POST /api/rollouts/release`; an AGL server has none: they are failed "runner shutdown").
- Unlike AGL's local controller, a `running` rollout the runner does not know is left alone
  (several runners may share one server). The runner renews the server-side lease of each
  rollout it runs (`POST /api/rollouts/heartbeat`, a tenth of `lease_seconds`, at most every
  10 s: a runner stalled for most of a lease keeps its rollouts); a runner that died without `stop()` stops renewing, and the server re-queues its
  rollouts as new attempts when their lease runs out (up to the server's `max_attempts`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import IO, Any

from agl_lab._agent_bootstrap import _await, split_agent_class
from agl_lab.agent import AgentContext, AgentSpec, agent_env, attempt_of
from agl_lab.agent_procs import MARK_VARIABLE, kill_rollout_processes, new_mark, terminate_rollout_processes
from agl_lab.client import AglAuthError, AglClient, AglHTTPError
from agl_lab.protocol import DEFAULT_ATTEMPT_ID, Rollout, reward_problem

log = logging.getLogger(__name__)

STDERR_TAIL_CHARS = 2000
AUTH_FAILURES_TO_GIVE_UP = 5  # consecutive polls answered 401: the key is wrong, stop polling
RECONCILE_INTERVAL_SECONDS = 1.0
HEARTBEAT_MAX_INTERVAL_SECONDS = 10.0  # renew leases at least this often (a tenth of the server's lease if shorter)
BEATS_PER_LEASE = 10  # heartbeats per lease: a lease survives a runner stalled for 9 beats (a loaded machine)
SHUTDOWN_MESSAGE = "runner shutdown"
_CLAIM_UNSUPPORTED = (404, 405)  # an AGL server: no claim / release route
# An idle runner's claim waits this long on the server for a rollout (a long poll): idle runners
# cost one request per this many seconds each, yet a new rollout starts at once. It also bounds
# how late stop(), the heartbeat and the reconcile run while the queue is empty.
CLAIM_WAIT_SECONDS = 0.5
# With no agent live there is no reconcile or heartbeat to run: the claim waits this long (stop()
# answers within it), so a runner idle between steps costs one request per 2 s, not two a second.
IDLE_CLAIM_WAIT_SECONDS = 2.0
_LIST_LIMIT = 500
# The runner's AglClient: 5 attempts 0.1, 0.2, 0.4, 0.8 s apart for idempotent calls (and for
# the terminal PATCH and the reward, which the runner resends on purpose).
_RETRIES = {"max_retries": 4, "backoff_base": 0.1, "backoff_cap": 2.0}


# ---------------------------------------------------------------------------------------------
# One claimed rollout
# ---------------------------------------------------------------------------------------------


@dataclass
class _Execution:
    rollout: Rollout
    timeout: float
    claimed_at: float  # time.monotonic() of the successful claim
    ctx: AgentContext | None = None
    proc: subprocess.Popen | None = None
    mark: str | None = None  # the agent subprocess's AGL_LAB_ROLLOUT_MARK (agl_lab.agent_procs)
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)  # set by the outcome decision
    finished: bool = False
    stopping: bool = False  # stop() terminates the agent: its exit is stop()'s to report, not a failure

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id

    @property
    def attempt_id(self) -> str:
        return attempt_of(self.rollout)


def default_runner_id() -> str:
    """`host-pid-xxxx`: names a runner in the server's log and in release messages."""
    import secrets
    import socket

    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def _fmt_seconds(seconds: float) -> str:
    return f"{seconds:g}"


def _read_tail(fh: IO[bytes] | None, limit: int = STDERR_TAIL_CHARS) -> str:
    """Last `limit` characters of a binary temp file (stderr of an agent subprocess)."""
    if fh is None:
        return ""
    try:
        fh.flush()
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - 4 * limit))
        text = fh.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return ""
    return text[-limit:].strip()


# this host's keys an agent never inherits (it gets its rollout's token as AGL_KEY instead): the
# engine's key would let it call the engine past the gateway, the runner key claim other rollouts
HOST_SECRETS = frozenset({"AGL_ENGINE_KEY", "AGL_RUNNER_KEY"})


def _child_pythonpath() -> str:
    """PYTHONPATH for an agent subprocess: the runner's cwd and import path (a notebook's
    `sys.path` edits included), so the class the user names imports there as it does here."""
    parts = [os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(dict.fromkeys(parts))


# ---------------------------------------------------------------------------------------------
# Runner
# ---------------------------------------------------------------------------------------------


class Runner:
    """Claims queued rollouts from an agl_lab / AGL server and runs an agent for each.

        with Runner(server.url, key=server.config.key, agent=my_agent, concurrency=8):
            ...  # rollouts created meanwhile are executed in the background

    | argument                | meaning                                                          |
    |-------------------------|------------------------------------------------------------------|
    | server_url              | server the runner polls and patches                              |
    | key                     | bearer key for the runner and injected into agents (`AGL_KEY`)  |
    | agent                   | callable `agent(task, ctx) -> float | None`; or `"module:Class"`  |
    |                         | (subprocess); or None = each rollout's `config.local.agent_class` |
    | concurrency             | most agents running at once                                      |
    | poll_interval           | seconds between polls of the queue                               |
    | rollout_timeout_seconds | caps every rollout's `config.timeout_seconds`                    |
    | agent_server_url        | server URL put in the agents' URLs (default `server_url`)        |
    | request_timeout         | seconds per HTTP request of the runner                           |
    | runner_id               | names this runner in claims and releases (default host-pid-rand) |
    """

    def __init__(
        self,
        server_url: str,
        key: str = "",
        agent: AgentSpec = None,
        concurrency: int = 16,
        poll_interval: float = 0.05,
        rollout_timeout_seconds: float | None = None,
        agent_server_url: str | None = None,
        request_timeout: float = 10.0,
        runner_id: str | None = None,
    ):
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"Runner(concurrency=...) must be an int >= 1, got {concurrency!r}")
        if not poll_interval > 0:
            raise ValueError(f"Runner(poll_interval=...) must be > 0 seconds, got {poll_interval!r}")
        if rollout_timeout_seconds is not None and not rollout_timeout_seconds > 0:
            raise ValueError(
                f"Runner(rollout_timeout_seconds=...) must be > 0 or None, got {rollout_timeout_seconds!r}"
            )
        if isinstance(agent, str):
            split_agent_class(agent)  # a malformed class name fails here, not per rollout
        elif agent is not None and not callable(agent):
            raise TypeError(
                f"Runner(agent=...) must be a callable agent(task, ctx), a 'module:Class' string "
                f"or None (use each rollout's config.local.agent_class), got {type(agent).__name__}"
            )
        self.server_url = server_url.rstrip("/")
        self.agent_server_url = (agent_server_url or server_url).rstrip("/")
        self.key = key or ""
        self.agent = agent
        self.concurrency = concurrency
        self.poll_interval = float(poll_interval)
        self.rollout_timeout_seconds = rollout_timeout_seconds
        self.request_timeout = float(request_timeout)
        self._live: dict[str, _Execution] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: AglClient | None = None
        self.runner_id = runner_id or default_runner_id()
        self._claim_route = True  # False after an AGL server answered 404/405: list-then-PATCH
        self._counts = {"claimed": 0, "succeeded": 0, "failed": 0, "abandoned": 0, "released": 0, "conflicts": 0}
        self._last_reconcile = 0.0
        self._last_heartbeat, self._heartbeat_every = -math.inf, HEARTBEAT_MAX_INTERVAL_SECONDS
        self._last_warning: dict[str, float] = {}
        self.auth_error: str | None = None  # set when the server kept refusing the key (polling stopped)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Runner:
        """Start polling in a daemon thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("this Runner was already started; create a new Runner after stop()")
        self._client = AglClient(self.server_url, key=self.key, timeout=self.request_timeout, **_RETRIES)
        self._thread = threading.Thread(target=self._poll_loop, name="agl-runner-poll", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop claiming, terminate live agents (SIGTERM to each process group, SIGKILL after
        agent_procs.TERM_GRACE_SECONDS) and release their rollouts back to the queue (another
        runner runs them as their next attempt); on an AGL server, which cannot release, fail
        them with "runner shutdown".

        Bounded: waits at most about `timeout` seconds for threads; idempotent."""
        if self._thread is None or self._client is None or self._stop.is_set():
            return
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        live = self._live_snapshot()
        agents = []
        for ex in live:
            with ex.lock:
                ex.stopping = True
                if ex.proc is not None:
                    agents.append((ex.proc, ex.mark))
        terminate_rollout_processes(agents)  # a chance to clean up; what is left is killed by _finish
        released = self._release(live)
        for ex in live:
            if ex.rollout_id in released:
                self._finish(ex, None, None, count="released")
            else:
                self._finish(ex, "failed", SHUTDOWN_MESSAGE)
        for ex in live:
            if ex.thread is not None:
                ex.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():  # stuck in a slow server call: it exits at its timeout
            log.warning("runner poll thread still busy after %ss; leaving its HTTP client open", timeout)
        else:
            self._client.close()

    def __enter__(self) -> Runner:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        agent = (
            self.agent
            if isinstance(self.agent, str) or self.agent is None
            else getattr(self.agent, "__name__", type(self.agent).__name__)
        )
        state = "stopped" if self._stop.is_set() else "polling" if self._thread else "not started"
        return f"Runner({self.server_url}, agent={agent!r}, concurrency={self.concurrency}, {state}, {self.stats})"

    @property
    def running(self) -> list[str]:
        """Ids of the rollouts this runner is executing now."""
        with self._lock:
            return list(self._live)

    @property
    def stats(self) -> dict[str, int]:
        """Counts since start: claimed, succeeded, failed, abandoned (terminated, re-queued or
        deleted outside the runner), released (given back by stop), conflicts (409s of the
        list-then-PATCH claims against an AGL server), running."""
        with self._lock:
            return {**self._counts, "running": len(self._live)}

    # -- polling -----------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        refused = 0
        while not self._stop.is_set():
            try:
                self._tick()
                refused = 0
            except AglAuthError as exc:  # the key was changed or is wrong: retrying cannot help for long
                refused += 1
                if refused >= AUTH_FAILURES_TO_GIVE_UP:
                    self.auth_error = (
                        f"{self.server_url} rejected the key (401) {refused} times in a row: pass "
                        "the server's key (--key, --key-file or $AGL_KEY); this runner stopped polling"
                    )
                    log.error("%s", self.auth_error)
                    return
                self._warn("poll", f"runner poll of {self.server_url} answered 401, retrying: {exc}")
            except Exception as exc:  # server hiccup: log and keep polling
                refused = 0
                self._warn("poll", f"runner poll of {self.server_url} failed, retrying: {exc!r}")
            self._stop.wait(self.poll_interval if not refused else max(self.poll_interval, 0.2 * 2**refused))

    def _tick(self) -> None:
        started = time.monotonic()
        if self._live and started - self._last_reconcile >= RECONCILE_INTERVAL_SECONDS:
            self._reconcile(started)
            self._last_reconcile = started
        if self._live and self._heartbeat_every and started - self._last_heartbeat >= self._heartbeat_every:
            self._heartbeat()
            self._last_heartbeat = started
        free = self.concurrency - len(self._live)
        if free <= 0:
            return
        if self._claim_route:
            for rollout in self._claim_batch(free):
                self._launch(rollout)
            if self._claim_route:
                return
        for rollout in self._list_rollouts("queuing", limit=free + 16):
            if free <= 0 or self._stop.is_set():
                break
            if rollout.rollout_id in self._live:
                continue
            claimed = self._claim(rollout)
            if claimed is not None:
                self._launch(claimed)
                free -= 1

    def _claim_batch(self, free: int) -> list[Rollout]:
        """Up to `free` rollouts from the server's claim route, each claimed for this runner
        alone; [] (and the list-then-PATCH path from now on) on a server without one."""
        assert self._client is not None
        try:
            wait = CLAIM_WAIT_SECONDS if self._live else IDLE_CLAIM_WAIT_SECONDS
            claimed = self._client.claim_rollouts(free, runner_id=self.runner_id, wait_seconds=wait)
        except AglHTTPError as exc:
            if exc.status_code not in _CLAIM_UNSUPPORTED:
                raise
            log.info("server %s has no claim route (AGL); claiming by list-then-PATCH", self.server_url)
            self._claim_route = False
            return []
        return claimed

    def _release(self, live: list[_Execution]) -> set[str]:
        """Give the attempts of `live` back to the queue; the ids the server released."""
        assert self._client is not None
        if not live:
            return set()
        try:
            return set(
                self._client.release_rollouts(
                    {ex.rollout_id: ex.attempt_id for ex in live}, f"runner {self.runner_id} stopped"
                )
            )
        except AglHTTPError as exc:
            if exc.status_code not in _CLAIM_UNSUPPORTED:
                log.error("could not release %d rollout(s) (%r); failing them instead", len(live), exc)
        except Exception as exc:  # the server is unreachable: its leases re-queue them later
            log.error("could not release %d rollout(s) (%r); their leases will re-queue them", len(live), exc)
        return set()

    def _list_rollouts(self, state: str, limit: int = _LIST_LIMIT) -> list[Rollout]:
        """One page of rollouts in `state`, creation order. The queue page is kept small (free
        slots + a margin for rollouts other runners claim first): the server's event loop is
        shared with the gateway, so a 20 Hz poll must not serialise the whole queue."""
        assert self._client is not None
        return self._client.list_rollouts([state], limit=min(limit, _LIST_LIMIT))

    def _claim(self, rollout: Rollout) -> Rollout | None:
        """PATCH queuing -> running(attempt "0"); the claimed rollout, or None if taken/deleted."""
        assert self._client is not None
        try:
            return self._client.patch_status(rollout.rollout_id, state="running", last_attempt_id=DEFAULT_ATTEMPT_ID)
        except AglHTTPError as exc:
            if exc.status_code in (404, 409):  # deleted, or another runner claimed it first
                if exc.status_code == 409:
                    with self._lock:
                        self._counts["conflicts"] += 1
                return None
            raise

    def _reconcile(self, started: float) -> None:
        """Stop agents whose rollout the store no longer has running (terminated outside)."""
        running = self._list_rollouts("running")
        if len(running) >= _LIST_LIMIT:
            return  # a full page proves nothing about the rollouts beyond it
        alive = {r.rollout_id for r in running}
        for ex in self._live_snapshot():
            # Critical: only rollouts claimed before this listing was requested can be judged.
            if ex.claimed_at < started and ex.rollout_id not in alive:
                log.info("rollout %s was terminated or deleted outside the runner; stopping its agent", ex.rollout_id)
                self._finish(ex, None, None)

    def _heartbeat(self) -> None:
        """Renew the server-side leases of the rollouts this runner runs (every tenth of the lease)."""
        assert self._client is not None
        live = self._live_snapshot()
        try:
            answer = self._client.heartbeat([ex.rollout_id for ex in live], [ex.attempt_id for ex in live])
        except AglHTTPError as exc:
            if exc.status_code in (404, 405):  # an AGL server: no leases to renew
                log.info("server %s has no heartbeat route (AGL); runner leases disabled", self.server_url)
                self._heartbeat_every = 0.0
                return
            raise
        lost = set(answer.get("not_running") or ())
        for ex in live:
            if ex.rollout_id in lost:  # re-queued (lease expired), finished or deleted outside the runner
                log.info(
                    "rollout %s attempt %s is no longer this runner's; stopping its agent", ex.rollout_id, ex.attempt_id
                )
                self._finish(ex, None, None)
        lease = float(answer.get("lease_seconds") or 0.0)
        self._heartbeat_every = HEARTBEAT_MAX_INTERVAL_SECONDS
        if lease:
            self._heartbeat_every = min(HEARTBEAT_MAX_INTERVAL_SECONDS, lease / BEATS_PER_LEASE)

    def _live_snapshot(self) -> list[_Execution]:
        with self._lock:
            return list(self._live.values())

    def _warn(self, key: str, message: str, every: float = 10.0) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(key, -math.inf) >= every:
            self._last_warning[key] = now
            log.warning(message)

    # -- executions --------------------------------------------------------------------------

    def _timeout_of(self, rollout: Rollout) -> float:
        timeout = float(rollout.config.timeout_seconds or 3600)
        if self.rollout_timeout_seconds is not None:
            timeout = min(timeout, float(self.rollout_timeout_seconds))
        return timeout

    def _launch(self, rollout: Rollout) -> None:
        ex = _Execution(rollout=rollout, timeout=self._timeout_of(rollout), claimed_at=time.monotonic())
        with self._lock:
            self._live[ex.rollout_id] = ex
            self._counts["claimed"] += 1
        if self._stop.is_set():  # claimed while stop() was starting: give it straight back
            released = self._release([ex])
            self._finish(
                ex,
                None if released else "failed",
                None if released else SHUTDOWN_MESSAGE,
                count="released" if released else None,
            )
            return
        target = self._supervise_callable if callable(self.agent) else self._supervise_subprocess
        ex.thread = threading.Thread(target=target, args=(ex,), daemon=True, name=f"agl-rollout-{ex.rollout_id[:8]}")
        ex.thread.start()

    def _supervise_callable(self, ex: _Execution) -> None:
        """Run the callable in an abandonable daemon thread; decide on its outcome."""
        ctx = ex.ctx = AgentContext.of(ex.rollout, self.agent_server_url, self.key, client=self._client)
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                value = self.agent(ex.rollout.input, ctx)  # type: ignore[misc]
                if inspect.isawaitable(value):  # an `async def` agent
                    value = asyncio.run(_await(value))
                outcome["value"] = value
            except BaseException as exc:  # any agent failure, SystemExit included, fails the rollout
                outcome["error"], outcome["traceback"] = exc, traceback.format_exc()
            finally:
                done.set()
                ex.wake.set()

        threading.Thread(target=work, daemon=True, name=f"agl-agent-{ex.rollout_id[:8]}").start()
        ex.wake.wait(ex.timeout)
        if ex.finished:  # decided elsewhere: shutdown or terminated outside
            return
        if not done.is_set():
            self._finish(ex, "failed", f"agent timed out after {_fmt_seconds(ex.timeout)} s")
            return
        state, message = self._judge_callable(ex, outcome)
        self._finish(ex, state, message)

    def _judge_callable(self, ex: _Execution, outcome: dict[str, Any]) -> tuple[str, str | None]:
        """(state, error_message) from what the callable returned; posts a returned reward."""
        if "error" in outcome:
            exc = outcome["error"]
            tb = outcome["traceback"].strip()[-STDERR_TAIL_CHARS:]
            return "failed", f"agent raised {type(exc).__name__}: {exc}\n{tb}"
        value = outcome.get("value")
        if value is None:
            return "succeeded", None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return "failed", (
                f"agent returned {type(value).__name__} {value!r:.80}; "
                "return a float reward (posted as the reward event) or None"
            )
        if (problem := reward_problem(value)) is not None:  # NaN, inf, beyond float32 (1e39, 10**400)
            return "failed", f"agent returned an unusable reward: {problem}; return a finite float32 or None"
        assert self._client is not None
        try:  # resent on failure: a duplicate reward event carries the same value (last one wins)
            self._client.add_event(ex.rollout_id, ex.attempt_id, "reward", {"value": float(value)}, retry=True)
        except Exception as exc:
            return "failed", f"could not record the agent's reward {value}: {exc!r}"
        return "succeeded", None

    def _agent_class_of(self, rollout: Rollout) -> str:
        if isinstance(self.agent, str):
            return self.agent
        local = rollout.config.local
        if local is None or not local.agent_class:
            raise ValueError(
                "invalid rollout config: missing config.local.agent_class (set "
                "agentlightning.local.agent_class in the config, or pass Runner(agent=...))"
            )
        return local.agent_class

    def _spawn(self, ex: _Execution, stderr_file: IO[bytes]) -> subprocess.Popen:
        spec = self._agent_class_of(ex.rollout)
        env = {
            **{k: v for k, v in os.environ.items() if k not in HOST_SECRETS},
            "PYTHONPATH": _child_pythonpath(),
            **agent_env(ex.rollout, self.agent_server_url, self.key),
            MARK_VARIABLE: ex.mark or "",  # inherited by whatever it starts: daemons are found by it
        }
        argv = [sys.executable, "-m", "agl_lab._agent_bootstrap", spec]
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stderr=stderr_file, start_new_session=True)

    def _supervise_subprocess(self, ex: _Execution) -> None:
        """Spawn the AGL agent class in its own session; wait, time out or report its exit."""
        with tempfile.TemporaryFile(prefix="agl-agent-stderr-") as stderr_file:
            ex.mark = new_mark(ex.rollout_id)
            try:
                proc = self._spawn(ex, stderr_file)
            except Exception as exc:
                self._finish(ex, "failed", f"local subprocess spawn failed: {exc}")
                return
            with ex.lock:
                ex.proc, decided = proc, ex.finished
            if decided:  # shutdown raced the spawn
                kill_rollout_processes(proc, ex.mark)
                return
            try:
                rc = proc.wait(timeout=ex.timeout)
            except subprocess.TimeoutExpired:
                self._finish(ex, "failed", f"local subprocess timed out after {_fmt_seconds(ex.timeout)} s")
                return
            if ex.stopping:  # terminated by stop(), which releases or fails the rollout itself
                return
            if rc == 0:
                self._finish(ex, "succeeded", None)
                return
            tail = _read_tail(stderr_file)
            message = f"subprocess exited with code {rc}" + (f"; stderr tail:\n{tail}" if tail else "")
            self._finish(ex, "failed", message)

    def _finish(self, ex: _Execution, state: str | None, message: str | None, count: str | None = None) -> bool:
        """Decide the outcome of `ex` once: stop its agent, PATCH `state` (None = no PATCH,
        the store already ended or re-queued it), free its slot, count it (`count`, default the
        state or "abandoned"). False if it was already decided."""
        with ex.lock:
            if ex.finished:
                return False
            ex.finished = True
            proc, mark = ex.proc, ex.mark
        if ex.ctx is not None:
            ex.ctx.cancelled.set()
        ex.wake.set()
        try:
            if proc is not None:
                kill_rollout_processes(proc, mark)  # the leader has exited or must; its tools and daemons go too
            if state is not None:
                self._patch_terminal(ex, state, message)
        finally:
            with self._lock:
                self._live.pop(ex.rollout_id, None)
                self._counts[count or state or "abandoned"] += 1
        return True

    def _patch_terminal(self, ex: _Execution, state: str, message: str | None) -> None:
        """PATCH `state` for the attempt `ex` runs (`?attempt_id=`: 409 once it is not running
        it, so a lost attempt never ends the next one; an AGL server ignores the parameter)."""
        assert self._client is not None
        rollout_id = ex.rollout_id
        fields: dict[str, Any] = {"state": state}
        if message is not None:
            fields["error_message"] = message
        try:  # resent on failure (not while stopping, to keep stop() bounded): a resend gets 409
            self._client.patch_status(rollout_id, retry=not self._stop.is_set(), attempt_id=ex.attempt_id, **fields)
        except Exception as exc:
            if isinstance(exc, AglHTTPError) and exc.status_code in (404, 409):  # deleted / decided elsewhere
                log.info("rollout %s: PATCH %s answered %d; leaving it", rollout_id, state, exc.status_code)
                return
            log.error("rollout %s: could not PATCH %s (%r); it stays running on the server", rollout_id, state, exc)
