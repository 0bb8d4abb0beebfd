"""The execution side a Trainer owns: where agents run and how their calls reach the engine.

    Execution(cfg, engine, agent)
      key        the admin key (an embedded server without one gets a fresh random key)
      server     EmbeddedServer (store + gateway in this process), or None for an external
                 `agl-lab serve` / AGL controller at `agentlightning.agl_base_url`
      client     AglClient on `base_url`
      runner     Runner executing `agent` for each queued rollout (None: agents run elsewhere)
      hooks      RolloutHooks from `agentlightning.hooks` (on_startup has run), or None

Per rollout phase the Trainer opens the gateway with `serving(engine)`: the engine's endpoints
are registered under its current policy version, then `agl_lab.phases.rollout_phase` runs the
phase (serve; sync mode aborts stray generations at the end, async mode pauses the gateway and
drains it, bounded), also when the collection raises. `close()` stops the pieces in reverse
order of their start.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agl_lab import config as config_mod
from agl_lab.phases import rollout_phase


class Execution:
    """Server, client, runner, key and hooks of one Trainer; see the module docstring."""

    def __init__(self, cfg: Any, *, engine: Any, agent: Callable | str | None):
        lab, agl = cfg.agl_lab, cfg.agentlightning
        self.cfg = cfg
        self._closers: list[Callable[[], None]] = []
        self.server = self.runner = self.hooks = None
        try:
            self._start(cfg, engine, agent)
            if agl.hooks:
                from agl_lab.hooks import load_hooks

                self.hooks = load_hooks(str(agl.hooks))
                self.hooks.on_startup(self.client)  # AGL passes no store here; we pass the client
        except BaseException:
            self.close()
            raise
        self.rollout_config = _rollout_config(agl)
        self.timeout_seconds = config_mod.rollout_wait_timeout(cfg)
        self.poll_interval = float(lab.rollout.poll_interval_seconds)
        self.keep_repeated_prompts = bool(lab.rollout.keep_repeated_prompts)
        # overlap (docs/engines.md "Overlap"): 0 = the synchronous loop, this class as it always was
        self.max_staleness = int(lab.rollout.get("max_staleness", 0) or 0)
        self.stale_groups = str(lab.rollout.get("stale_groups", "drop"))
        self._published: int | None = None  # the version registered with the gateway under overlap

    def _start(self, cfg: Any, engine: Any, agent: Callable | str | None) -> None:
        lab, agl = cfg.agl_lab, cfg.agentlightning
        from agl_lab.client import AglClient

        # An embedded server is never left open: without a configured key it gets a fresh one
        # (agents receive it through their context / AGL_KEY like any other key).
        self.key = str(agl.agl_key or "") or (secrets.token_hex(16) if lab.server.embedded else "")
        if lab.server.embedded:
            import os

            from agl_lab.addresses import ENGINE_KEY_ENV
            from agl_lab.server.embedded import EmbeddedServer

            self.server = EmbeddedServer(
                key=self.key,
                upstream_key=os.environ.get(ENGINE_KEY_ENV, ""),  # the engine's key beyond loopback (addresses.py)
                runner_key=os.environ.get("AGL_RUNNER_KEY", ""),  # runner hosts' scoped key (server/guard.py)
                host=str(lab.server.get("host") or "127.0.0.1"),  # agl_lab.server.host / advertise_host: addresses.py
                **({"port": int(lab.server.port)} if lab.server.get("port") else {}),  # 0/unset: a free port
                advertise_host=lab.server.get("advertise_host"),
                store=str(lab.server.store),
                token_preserving=bool(lab.server.token_preserving),
                call_seed=int(lab.seed) if lab.server.seed_calls else None,
                **config_mod.server_overrides(cfg),  # lease_seconds, upstream_* …: ServerConfig's defaults if unset
                default_proxy={
                    "model_name": engine.model_name,
                    "include_log_probs": bool(lab.server.include_log_probs),
                    # Critical: the gateway samples training calls at the temperature the update
                    # recomputes old logprobs at. AGL v1 let the two differ silently; here both
                    # come from actor_rollout_ref.rollout.temperature.
                    "train": {"temperature": float(cfg.actor_rollout_ref.rollout.temperature)},
                    "val": {"temperature": float(lab.server.val_temperature)},
                },
            )
            self._closers.append(self.server.stop)
            if lab.server.token_preserving:
                self.server.set_tokenizer(engine.model_name, engine.tokenizer)
            self.base_url = self.server.url
        else:
            from agl_lab.client import server_urls

            urls = server_urls(agl.agl_base_url if isinstance(agl.agl_base_url, str) else list(agl.agl_base_url))
            self.base_url = urls[0]  # several servers of one ledger: the client fails over to the next
        self.client = AglClient(self.base_url if lab.server.embedded else urls, key=self.key)
        self._closers.append(self.client.close)
        if not lab.server.embedded:
            check_external_server(
                self.client, model_name=engine.model_name, temperature=float(cfg.actor_rollout_ref.rollout.temperature)
            )
        if lab.runner.enabled and (agent is not None or agl.local.agent_class):
            from agl_lab.runner import Runner

            timeout = lab.runner.agent_timeout_seconds
            self.runner = Runner(
                self.base_url,
                key=self.key,
                agent=agent,
                concurrency=int(lab.runner.concurrency),
                rollout_timeout_seconds=None if timeout is None else float(timeout),
            )
            self.runner.start()
            self._closers.append(self.runner.stop)

    def manager_args(self) -> dict[str, Any]:
        """The keyword arguments both rollout managers take from the execution side."""
        return dict(
            rollout_config=self.rollout_config,
            hooks=self.hooks,
            timeout_seconds=self.timeout_seconds,
            poll_interval=self.poll_interval,
            keep_repeated_prompts=self.keep_repeated_prompts,
        )

    @contextlib.contextmanager
    def serving(self, engine: Any, *, drain: bool, reason: str) -> Iterator[dict[str, Any]]:
        """One rollout phase (`phases.rollout_phase`) with the engine's endpoints registered first.

        Yields the phase's metrics dict; after a phase that ended normally it holds
        `training/n_aborted_generations` (sync) or the gateway's drain figures (async), and the
        engine's serving work over the phase (`Engine.serving_counters`: `rollout/prefill_tokens`,
        `rollout/cached_tokens`, `rollout/decode_steps`). A
        collection that raises still aborts or drains, and leaves the engine serving.
        """
        if self.max_staleness:
            yield from self._overlapped(engine)
            return
        from agl_lab.protocol import Model

        # stale endpoints of this model (a previous engine, an earlier run) go first; other
        # trainers' models on a shared store stay (an AGL server ignores the filter: it clears all)
        self.client.delete_models(engine.model_name)
        self.client.register_models(
            [Model(model=engine.model_name, endpoint=ep, version=engine.policy_version) for ep in engine.endpoints()]
        )
        before = engine.serving_counters() if hasattr(engine, "serving_counters") else {}
        with rollout_phase(
            engine,
            self.client,
            drain=drain,
            reason=reason,
            drain_timeout=float(self.cfg.agl_lab.rollout.drain_timeout_seconds),
        ) as metrics:
            yield metrics
            if len(self.client.urls) > 1:  # agentlightning.agl_base_url lists several servers of one ledger
                metrics["execution/server_failovers"] = self.client.failovers  # since the start
        after = engine.serving_counters() if before else {}
        # the engine's own server over this phase: rollout/prefill_tokens, cached_tokens, decode_steps
        metrics.update({f"rollout/{k}": after[k] - v for k, v in before.items() if k in after})
        if metrics.get("rollout/decode_steps") and "rollout/decode_rows" in metrics:  # rows a decode step ran
            metrics["rollout/mean_decode_batch"] = metrics["rollout/decode_rows"] / metrics["rollout/decode_steps"]
        if metrics.get("rollout/decode_steps") and "rollout/shared_columns" in metrics:  # the block a step read once
            metrics["rollout/mean_shared_columns"] = metrics["rollout/shared_columns"] / metrics["rollout/decode_steps"]

    def _overlapped(self, engine: Any) -> Iterator[dict[str, Any]]:
        """A rollout phase under overlap: the engine's endpoints registered once (then at each
        `publish`), and nothing ended at its end — carried-over and next-step groups keep
        generating on the serving copy while the update trains."""
        if self._published != engine.serving_version:
            self._register(engine)
        engine.resume()
        self.client.resume()
        before = engine.serving_counters()
        metrics: dict[str, Any] = {}
        yield metrics
        after = engine.serving_counters()
        metrics.update({f"rollout/{k}": after[k] - v for k, v in before.items() if k in after})

    def _register(self, engine: Any) -> None:
        from agl_lab.protocol import Model

        self.client.delete_models(engine.model_name)
        version = engine.serving_version
        self.client.register_models(
            [Model(model=engine.model_name, endpoint=ep, version=version) for ep in engine.endpoints()]
        )
        self._published = version

    def publish(self, engine: Any, *, step: int) -> dict[str, float]:
        """Overlap's step boundary: drain the gateway (calls in flight finish on the old weights and
        keep the old `model_version`), copy the trained weights into the serving copy
        (`LocalEngine.publish`), register the new version, open the gateway again. A call never
        carries a version other than the weights that answered it."""
        from agl_lab.phases import drain_gateway

        timeout = float(self.cfg.agl_lab.rollout.drain_timeout_seconds)
        metrics = drain_gateway(self.client, reason=f"publish step={step}", timeout=timeout)
        try:
            engine.publish(timeout)
            self._register(engine)
        finally:
            self.client.resume()
        return {
            "training/overlap/publish_inflight_at_pause": metrics["training/async/proxy_inflight_at_pause"],
            "training/overlap/publish_drain_seconds": metrics["training/async/proxy_drain_seconds"],
            "training/overlap/serving_version": float(engine.serving_version),
        }

    def close(self) -> None:
        """Stop runner, client and server (reverse start order). Idempotent; never raises."""
        while self._closers:
            with contextlib.suppress(Exception):
                self._closers.pop()()


def check_external_server(client: Any, *, model_name: str, temperature: float) -> None:
    """An external server (`agl_lab.server.embedded=false`) must route the engine's model name and
    sample training calls at the temperature the update recomputes logprobs at; otherwise every
    call answers 503 ("No servers available for model …") or trains on the wrong distribution.
    Raises ConfigError with the `agl-lab serve` flags that fix it. A server without
    `/proxy/config` (Agent Lightning's own) cannot be asked: one warning says so."""
    import warnings

    from agl_lab.client import AglHTTPError

    try:
        remote = client.proxy_config()
    except AglHTTPError as exc:
        if exc.status_code != 404:
            raise
        warnings.warn(
            f"the server at {client.base_url} has no /proxy/config (not agl_lab's server?): its model name "
            f"and train temperature could not be checked against the engine's ({model_name!r}, "
            f"{temperature:g}); make sure they match",
            config_mod.ConfigWarning,
            stacklevel=3,
        )
        return
    problems = []
    if remote.get("model_name") != model_name:
        problems.append(
            f"its default_proxy.model_name is {remote.get('model_name')!r} but the engine registers its "
            f"endpoints as {model_name!r} (every proxied call would answer 503): start it with "
            f"`agl-lab serve --model-name {model_name}`"
        )
    if float(remote.get("train_temperature", -1)) != temperature:
        problems.append(
            f"it samples training calls at temperature {remote.get('train_temperature')} but "
            f"actor_rollout_ref.rollout.temperature={temperature:g} (the update would recompute old "
            f"logprobs at another temperature than the one sampled): start it with "
            f"`--train-temperature {temperature:g}`, or set actor_rollout_ref.rollout.temperature to "
            "the server's"
        )
    if problems:
        raise config_mod.ConfigError(
            f"agl_lab.server.embedded=false: the server at {client.base_url} does not match "
            "this engine: " + "; ".join(problems)
        )


def _rollout_config(agl: Any) -> dict[str, Any]:
    """The `config` every rollout is created with: its timeout and how to run the agent."""
    rc: dict[str, Any] = {"timeout_seconds": int(agl.rollout_timeout_seconds)}
    if agl.local.agent_class:
        rc["local"] = {
            "agent_class": str(agl.local.agent_class),
            "env_map": config_mod.as_listconfig_free(agl.local.env_map) or {},
        }
    if agl.k8s.job_template_path:
        rc["k8s"] = {"job_template": Path(agl.k8s.job_template_path).read_text()}
    return rc
