"""`RayRunner`: the `Runner` with each agent executed as a Ray task on a cluster's nodes.

    agl-lab runner --server http://trainer-host:8080 --key-file runner.key --agent my_agents:solve --ray HEAD:6379

What stays in the runner process, as in `agl_lab.runner.Runner`: claiming, heartbeats (leases),
the reconcile with the store, timeouts and the terminal PATCH of each attempt. What moves: the
agent's execution, one Ray task per rollout scheduled with the `SPREAD` strategy (`max_retries=0`:
Ray never re-runs it by itself; a re-run is the store's next attempt). The runner mints the
rollout's token (`AgentContext.of`) and ships only the token and URLs: a node never sees the
runner's key.

On the node, the task first posts a `ray_node` event of the attempt (`{"node_id", "ip", "pid"}`),
then runs the agent: a callable `agent(task, ctx)` in the Ray worker, or an AGL agent class
(`"module:Class"`) in a subprocess of the worker (killed with the worker: `PR_SET_PDEATHSIG`).

| how the task ended                           | the attempt                                          |
|----------------------------------------------|------------------------------------------------------|
| the agent returned / exited 0                | succeeded (a returned reward is posted, as Runner)   |
| the agent raised / exited non-zero           | failed with the agent's error                        |
| the node or worker died (`RayError` that is  | released back to the queue (the next claim is the    |
|   not the agent's own `RayTaskError`)        | next attempt), counted `node_lost`; after            |
|                                              | `node_loss_retries` such attempts: failed            |
| timeout, shutdown, terminated outside        | the task is cancelled (`ray.cancel(force=True)`)     |

Code on the nodes: `agl_lab` and the agent's top-level module or package (when it is not installed
in site-packages) are shipped as Ray `py_modules`, so the nodes need only agl_lab's dependencies.
Agents named per rollout (`config.local.agent_class`, no `agent=`) must be importable on the nodes.

`import ray` happens only here, in `start()`: the plain `agl-lab runner` stays light.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from agl_lab._agent_bootstrap import _await, split_agent_class
from agl_lab.agent import AgentContext, agent_env
from agl_lab.runner import HOST_SECRETS, Runner, _Execution, _fmt_seconds, _read_tail

log = logging.getLogger(__name__)

NODE_EVENT = "ray_node"  # the event type naming the Ray node an attempt runs on
_WAIT_STEP_SECONDS = 1.0  # the supervisor checks for an outside decision (shutdown, reconcile) this often
_PR_SET_PDEATHSIG = 1


def _module_path(module_name: str) -> str | None:
    """The file or package directory of `module_name`'s top-level module to ship to the nodes;
    None for a module installed in site-packages (the nodes have their own install)."""
    top = module_name.split(".")[0]
    if top in ("__main__", "agl_lab"):
        return None
    module = importlib.import_module(top)
    paths = list(getattr(module, "__path__", None) or [])
    path = paths[0] if paths else getattr(module, "__file__", None)
    if not path or any(part in ("site-packages", "dist-packages") for part in Path(path).parts):
        return None
    return str(path)


def py_modules_for(agent: Any) -> list[str]:
    """Ray `py_modules` for the agent: the agl_lab package and the agent's own top-level module.

    A callable defined in `__main__` cannot be imported on a node: ValueError saying so."""
    import agl_lab

    modules = [str(Path(agl_lab.__file__).parent)]
    if agent is None:
        return modules
    if isinstance(agent, str):
        module_name = split_agent_class(agent)[0]
    else:
        module_name = getattr(agent, "__module__", None) or ""
        if module_name == "__main__":
            raise ValueError(
                "RayRunner(agent=...): a function defined in __main__ (a notebook or script) cannot be "
                "imported on the Ray nodes; put it in a module (my_agents.py) and pass my_agents:solve"
            )
    path = _module_path(module_name) if module_name else None
    return modules + ([path] if path else [])


def wait_for_head(address: str | None, timeout: float) -> None:
    """Return once the Ray head at `address` ("HOST:PORT") accepts a TCP connection; ConnectionError
    naming the address after `timeout` seconds of refusals or silence. Other addresses ("auto",
    None, "ray://…") are left to `ray.init`, which fails on its own when it finds no cluster."""
    host, sep, port = (address or "").rpartition(":")
    if not sep or "://" in (address or "") or not port.isdigit():
        return
    host = host.strip("[]")  # an IPv6 address: [::1]:6379
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() + 1.0 >= deadline:
                raise ConnectionError(
                    f"no Ray head answers at {address} within {timeout:g} s ({exc}): check --ray ADDRESS "
                    "(the address `ray start --head` prints), or wait longer with --ray-connect-timeout"
                ) from None
        time.sleep(1.0)


def _die_with_parent() -> None:  # an agent subprocess's preexec_fn: SIGKILL when the Ray worker dies
    import ctypes
    import signal

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_on_node(agent: Any, ctx_fields: dict[str, Any], rollout: Any, env: dict[str, str]) -> dict[str, Any]:
    """The Ray task: post the `ray_node` event, run the agent, return what happened.

    Returns {"node_id", "value"} for a callable (its exception propagates as Ray's `RayTaskError`),
    {"node_id", "returncode", "stderr_tail"} for an AGL agent class run in a subprocess."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    ctx = AgentContext(**ctx_fields, rollout=rollout)  # no client: events go with the rollout's token
    ctx.emit(NODE_EVENT, {"node_id": node_id, "ip": ray.util.get_node_ip_address(), "pid": os.getpid()})
    if callable(agent):
        value = agent(rollout.input, ctx)
        if inspect.isawaitable(value):  # an `async def` agent
            value = asyncio.run(_await(value))
        return {"node_id": node_id, "value": value}
    child_env = {
        **{k: v for k, v in os.environ.items() if k not in HOST_SECRETS},
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in sys.path if p and os.path.isdir(p))),
        **env,
    }
    argv = [sys.executable, "-m", "agl_lab._agent_bootstrap", agent]
    with tempfile.TemporaryFile(prefix="agl-agent-stderr-") as stderr_file:
        rc = subprocess.call(
            argv, env=child_env, stdin=subprocess.DEVNULL, stderr=stderr_file, preexec_fn=_die_with_parent
        )
        return {"node_id": node_id, "returncode": rc, "stderr_tail": _read_tail(stderr_file) if rc else ""}


class RayRunner(Runner):
    """A `Runner` whose agents run as Ray tasks across a cluster (module docstring).

        with RayRunner(server.url, key=key, agent="my_agents:solve", address="head:6379"):
            ...

    | argument          | meaning                                                             |
    |-------------------|---------------------------------------------------------------------|
    | address           | the cluster (`ray.init(address=...)`: "auto", "HOST:PORT", None)     |
    | cpus_per_agent    | Ray CPUs each agent task reserves (default 1; 0.25: four per CPU)    |
    | node_loss_retries | attempts a rollout may lose to dead nodes before it is failed        |
    | connect_timeout   | seconds a HOST:PORT address may take to accept a connection (30)    |
    | runtime_env       | extra Ray runtime_env (its py_modules get agl_lab and the agent's)   |
    | **kwargs          | the `Runner`'s arguments                                            |
    """

    def __init__(
        self,
        server_url: str,
        *,
        address: str | None = "auto",
        cpus_per_agent: float = 1.0,
        node_loss_retries: int = 2,
        runtime_env: dict[str, Any] | None = None,
        connect_timeout: float = 30.0,
        **kwargs: Any,
    ):
        super().__init__(server_url, **kwargs)
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float)) or connect_timeout <= 0:
            raise ValueError(f"RayRunner(connect_timeout=...) must be a number of seconds > 0, got {connect_timeout!r}")
        self.connect_timeout = float(connect_timeout)
        if isinstance(cpus_per_agent, bool) or not isinstance(cpus_per_agent, (int, float)) or cpus_per_agent < 0:
            raise ValueError(f"RayRunner(cpus_per_agent=...) must be a number >= 0, got {cpus_per_agent!r}")
        if isinstance(node_loss_retries, bool) or not isinstance(node_loss_retries, int) or node_loss_retries < 0:
            raise ValueError(f"RayRunner(node_loss_retries=...) must be an int >= 0, got {node_loss_retries!r}")
        self.address = address
        self.cpus_per_agent = float(cpus_per_agent)
        self.node_loss_retries = node_loss_retries
        env = dict(runtime_env or {})
        env["py_modules"] = list(env.get("py_modules") or []) + [
            m for m in py_modules_for(self.agent) if m not in (env.get("py_modules") or [])
        ]
        self.runtime_env = env
        self._counts["node_lost"] = 0
        self._refs: dict[str, Any] = {}  # rollout id -> its agent's Ray task (ObjectRef), while it runs
        self._task: Any = None
        self._connected = False

    def start(self) -> RayRunner:
        """Connect to the Ray cluster (`ray.init`), then start polling; returns self."""
        import ray

        if not ray.is_initialized():
            wait_for_head(self.address, self.connect_timeout)  # ray.init retries a dead address for ever
            if self.address is None:  # a local cluster: its agents at nice 0, not Ray's 15 (engine.init_ray)
                os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address=self.address, runtime_env=self.runtime_env, logging_level=logging.WARNING)
            self._connected = True
        self._task = ray.remote(run_on_node).options(
            scheduling_strategy="SPREAD", max_retries=0, num_cpus=self.cpus_per_agent, name="agl-agent"
        )
        super().start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """`Runner.stop` (agents' tasks cancelled, rollouts released), then leave the cluster."""
        super().stop(timeout)
        if self._connected:
            import ray

            self._connected = False
            ray.shutdown()

    def _supervise_ray(self, ex: _Execution) -> None:
        """Submit the agent's task, wait for it (or the timeout, or an outside decision), judge it."""
        import ray
        from ray.exceptions import RayError, RayTaskError

        ctx = AgentContext.of(ex.rollout, self.agent_server_url, self.key)
        fields = {name: getattr(ctx, name) for name in ("rollout_id", "attempt_id", "is_train")}
        fields.update(base_url=ctx.base_url, event_url=ctx.event_url, api_key=ctx.api_key)
        agent = self.agent
        try:
            if agent is None:
                agent = self._agent_class_of(ex.rollout)
            env = agent_env(ex.rollout, self.agent_server_url, self.key) if isinstance(agent, str) else {}
            ref = self._task.remote(agent, fields, ex.rollout, env)
        except Exception as exc:
            self._finish(ex, "failed", f"could not submit the agent's Ray task: {exc}")
            return
        with ex.lock:
            self._refs[ex.rollout_id], decided = ref, ex.finished
        if decided:  # shutdown raced the submission
            self._cancel(ex.rollout_id)
            return
        remaining = ex.timeout
        while not ex.finished and remaining > 0:
            step = min(_WAIT_STEP_SECONDS, remaining)
            ready, _ = ray.wait([ref], timeout=step)
            if ready:
                break
            remaining -= step
        if ex.finished:  # decided elsewhere: shutdown, terminated outside, lease lost
            return
        if remaining <= 0:
            self._finish(ex, "failed", f"agent timed out after {_fmt_seconds(ex.timeout)} s (Ray task cancelled)")
            return
        try:
            result = ray.get(ref)
        except RayTaskError as exc:  # the agent itself raised: fail the attempt with its error
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
            outcome = {"error": cause, "traceback": str(exc)}
            self._finish(ex, *self._judge_callable(ex, outcome))
            return
        except RayError as exc:  # the node or the worker died: not the agent's fault
            self._node_lost(ex, exc)
            return
        except Exception as exc:  # e.g. the result could not be deserialised
            self._finish(ex, "failed", f"agent's Ray task failed: {exc!r}\n{traceback.format_exc()[-1000:]}")
            return
        log.debug("rollout %s attempt %s ran on node %s", ex.rollout_id, ex.attempt_id, result.get("node_id"))
        if "returncode" in result:
            rc, tail = result["returncode"], result["stderr_tail"]
            if rc == 0:
                self._finish(ex, "succeeded", None)
            else:
                message = f"subprocess exited with code {rc} on Ray node {result['node_id']}"
                self._finish(ex, "failed", message + (f"; stderr tail:\n{tail}" if tail else ""))
            return
        self._finish(ex, *self._judge_callable(ex, {"value": result.get("value")}))

    # the Runner starts a supervisor thread on one of these per claimed rollout: both are the Ray one
    _supervise_callable = _supervise_subprocess = _supervise_ray

    def _finish(self, ex: _Execution, state: str | None, message: str | None, count: str | None = None) -> bool:
        """`Runner._finish`, and the agent's Ray task cancelled (timeout, shutdown, lost attempt)."""
        decided = super()._finish(ex, state, message, count)
        self._cancel(ex.rollout_id)
        return decided

    def _cancel(self, rollout_id: str) -> None:
        ref = self._refs.pop(rollout_id, None)
        if ref is not None:
            import ray

            try:
                ray.cancel(ref, force=True)  # a finished task: nothing happens
            except Exception as exc:  # the node is gone already
                log.info("rollout %s: cancelling its Ray task failed: %r", rollout_id, exc)

    def _node_lost(self, ex: _Execution, exc: BaseException) -> None:
        """The task died with its node or worker: give the attempt back to the queue (the next
        claim runs it as the next attempt), or fail it after `node_loss_retries` such attempts."""
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        lost_before = int(ex.attempt_id) if ex.attempt_id.isdigit() else 0
        if lost_before >= self.node_loss_retries:
            self._finish(ex, "failed", f"agent's Ray task lost ({why}) on attempt {ex.attempt_id}; not retried")
            return
        log.warning(
            "rollout %s attempt %s: its Ray task was lost (%s); releasing it", ex.rollout_id, ex.attempt_id, why
        )
        assert self._client is not None
        try:
            released = self._client.release_rollouts({ex.rollout_id: ex.attempt_id}, f"Ray node lost: {why:.300}")
        except Exception as err:  # the server is unreachable: its lease re-queues the rollout later
            log.error("rollout %s: could not release it after its node was lost (%r)", ex.rollout_id, err)
            released = []
        if ex.rollout_id in released:
            self._finish(ex, None, None, count="node_lost")
        else:
            self._finish(ex, "failed", f"agent's Ray task lost ({why}); the server did not release it")
