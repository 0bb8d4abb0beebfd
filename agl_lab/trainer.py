"""The stepwise Trainer: one GRPO step as three calls a notebook can run cell by cell.

    trainer = Trainer.from_config("configs/cpu_tiny.yaml", overrides=["data.train_batch_size=8"])
    ro = trainer.rollout()       # agents run through the gateway → completed rollouts
    b  = trainer.build_batch()   # triplets → rows → verl DataProto (+ rows/breaks/groups views)
    u  = trainer.update()        # advantages → drops → per-rollout loss → policy update → sync

Each stage uses the previous stage's result by default and accepts an explicit one, so a
notebook can rebuild a batch from the same rollouts with other settings. `step()` runs the
three, `fit()` loops with a progress bar, `validate()` runs one rollout per validation task.

Around the stages sit the execution-side pieces the Trainer owns for the local engine: an
embedded store + gateway, a runner that executes the agent for each queued rollout, and the
engine's OpenAI server. With `agl_lab.server.embedded=false` they are external processes
(`agl-lab serve`, an AGL controller) and the Trainer only talks HTTP to them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf

from agl_lab import config as config_mod
from agl_lab.data import TaskFeeder
from agl_lab.logger import MetricsLogger
from agl_lab.results import BatchResult, RolloutResult, UpdateResult

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Agentic GRPO, one stage per call. See the module docstring for the tour."""

    def __init__(
        self,
        cfg,
        *,
        engine=None,
        agent: Callable | str | None = None,
        train_dataset: Sequence[dict] | None = None,
        val_dataset: Sequence[dict] | None = None,
        run_dir: str | os.PathLike | None = None,
        console: bool = True,
    ):
        self.cfg = cfg
        lab = cfg.agl_lab
        seed_everything(int(lab.seed))
        self.global_step = 0
        self._closers: list[Callable[[], None]] = []
        self._last_rollout: RolloutResult | None = None
        self._last_batch: BatchResult | None = None
        self._last_update: UpdateResult | None = None

        self.task = None
        if agent is None and train_dataset is None and not cfg.agentlightning.local.agent_class:
            from agl_lab.tasks import get_task

            self.task = get_task(str(lab.task.name))
        self.agent = agent or (self.task.agent if self.task else None)
        self.train_dataset = list(train_dataset) if train_dataset is not None else (
            self.task.train_tasks(int(lab.task.n_train), seed=int(lab.seed)))
        self.val_dataset = list(val_dataset) if val_dataset is not None else (
            self.task.val_tasks(int(lab.task.n_val), seed=int(lab.seed) + 1) if self.task else [])
        self.feeder = TaskFeeder(self.train_dataset, seed=int(lab.seed), shuffle=bool(cfg.data.shuffle))

        try:
            self.engine = engine if engine is not None else self._make_engine()
            self._start_execution_side()
        except BaseException:
            self.close()
            raise
        self.run_dir = Path(run_dir or lab.run_dir or self._default_run_dir())
        self.metrics_logger = MetricsLogger(
            self.run_dir, console=console, wandb_mode=str(lab.wandb.mode),
            project=str(cfg.trainer.project_name), experiment=str(cfg.trainer.experiment_name),
            config=config_mod.to_container(cfg))
        self._closers.append(self.metrics_logger.close)
        self.async_manager = self._make_async_manager() if self.is_async else None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, path=None, overrides: Sequence[str] | Mapping | None = None,
                    engine: str | None = None, **kwargs) -> "Trainer":
        """Compose a config (see `agl_lab.config`) and build a Trainer on it.

        `engine="verl"` is the same as the override `agl_lab.engine=verl`.
        """
        overrides = list(overrides or []) if not isinstance(overrides, Mapping) else overrides
        if engine is not None:
            if isinstance(overrides, Mapping):
                overrides = {**overrides, "agl_lab": {**overrides.get("agl_lab", {}), "engine": engine}}
            else:
                overrides = [*overrides, f"agl_lab.engine={engine}"]
        cfg = config_mod.load_config(path, overrides)
        return cls(cfg, **kwargs)

    @property
    def is_async(self) -> bool:
        return bool(self.cfg.agentlightning.async_rollout.enabled)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _default_run_dir(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return Path("runs") / f"{self.cfg.trainer.experiment_name}-{stamp}"

    def _make_engine(self):
        lab = self.cfg.agl_lab
        if lab.engine == "verl":
            from agl_lab.engines.verl import VerlEngine

            engine = VerlEngine(self.cfg, train_dataset=self.train_dataset, val_dataset=self.val_dataset)
            self._closers.append(engine.close)  # its workers, replicas and the Ray cluster it started
            return engine
        from agl_lab.engines.local import LocalEngine

        engine = LocalEngine.from_config(self.cfg)
        self._closers.append(engine.close)
        if self.task is not None and int(lab.model.warm_start_steps) > 0 and lab.model.path is None:
            from agl_lab.tasks.warmstart import warm_start

            warm_start(engine.model, engine.tokenizer, self.task.name,
                       steps=int(lab.model.warm_start_steps), seed=int(lab.seed))
        return engine

    def _start_execution_side(self) -> None:
        lab, agl = self.cfg.agl_lab, self.cfg.agentlightning
        from agl_lab.client import AglClient

        # An embedded server is never left open: without a configured key it gets a fresh one
        # (agents receive it through their context / AGL_KEY like any other key).
        self.key = str(agl.agl_key or "") or (secrets.token_hex(16) if lab.server.embedded else "")
        if lab.server.embedded:
            from agl_lab.server.embedded import EmbeddedServer

            self.server = EmbeddedServer(
                key=self.key,
                store=str(lab.server.store),
                token_preserving=bool(lab.server.token_preserving),
                call_seed=int(lab.seed) if lab.server.seed_calls else None,
                default_proxy={
                    "model_name": self.engine.model_name,
                    "include_log_probs": bool(lab.server.include_log_probs),
                    # Critical: the gateway's sampling temperature must be the temperature
                    # the update recomputes old logprobs at (AGL flaw §8.11 made impossible).
                    "train": {"temperature": float(self.cfg.actor_rollout_ref.rollout.temperature)},
                    "val": {"temperature": float(lab.server.val_temperature)},
                },
            )
            self._closers.append(self.server.stop)
            if lab.server.token_preserving and hasattr(self.server, "set_tokenizer"):
                self.server.set_tokenizer(self.engine.model_name, self.tokenizer)
            self.base_url = self.server.url
        else:
            self.server = None
            self.base_url = str(agl.agl_base_url).rstrip("/")
        self.client = AglClient(self.base_url, key=self.key)
        self._closers.append(self.client.close)
        self.runner = None
        if lab.runner.enabled and (self.agent is not None or agl.local.agent_class):
            from agl_lab.runner import Runner

            timeout = lab.runner.agent_timeout_seconds
            self.runner = Runner(self.base_url, key=self.key, agent=self.agent,
                                 concurrency=int(lab.runner.concurrency),
                                 rollout_timeout_seconds=None if timeout is None else float(timeout))
            self.runner.start()
            self._closers.append(self.runner.stop)

    def _rollout_config(self) -> dict[str, Any]:
        agl = self.cfg.agentlightning
        rc: dict[str, Any] = {"timeout_seconds": int(agl.rollout_timeout_seconds)}
        if agl.local.agent_class:
            rc["local"] = {"agent_class": str(agl.local.agent_class),
                           "env_map": config_mod.as_listconfig_free(agl.local.env_map) or {}}
        if agl.k8s.job_template_path:
            rc["k8s"] = {"job_template": Path(agl.k8s.job_template_path).read_text()}
        return rc

    def _load_hooks(self):
        if not hasattr(self, "_hooks"):
            self._hooks = None
            if self.cfg.agentlightning.hooks:
                from agl_lab.hooks import load_hooks

                self._hooks = load_hooks(str(self.cfg.agentlightning.hooks))
                self._hooks.on_startup(self.client)  # AGL passes no store (flaw §8.23)
        return self._hooks

    def _make_async_manager(self):
        from agl_lab.rollout import AsyncRolloutManager

        lab, agl = self.cfg.agl_lab, self.cfg.agentlightning
        return AsyncRolloutManager(
            self.client, n=int(self.cfg.actor_rollout_ref.rollout.n),
            train_batch_size=int(self.cfg.data.train_batch_size),
            async_train_batch_size=agl.async_rollout.async_train_batch_size,
            rollout_config=self._rollout_config(), hooks=self._load_hooks(),
            timeout_seconds=float(lab.rollout.wait_timeout_seconds),
            poll_interval=float(lab.rollout.poll_interval_seconds))

    # ------------------------------------------------------------------ stage 1: rollout

    def _register_endpoints(self) -> None:
        """Delete stale endpoints, then register the engine's with the current policy version."""
        from agl_lab.protocol import Model

        self.client.delete_models()
        self.client.register_models([
            Model(model=self.engine.model_name, endpoint=ep, version=self.engine.policy_version)
            for ep in self.engine.endpoints()])

    def rollout(self, tasks: Sequence[dict] | None = None, *, is_train: bool = True) -> RolloutResult:
        """Run the agents on the next batch of tasks (n rollouts each) and collect them.

        Sync mode waits for every rollout, then aborts stray generations; async mode
        completes when `train_batch_size` whole groups are done and carries the rest over.
        """
        from agl_lab.records import lifecycle_metrics
        from agl_lab.rollout import SyncRolloutManager

        t0 = time.time()
        metrics: dict[str, Any] = {"timing/step_start_wall": t0}
        self._register_endpoints()
        self.engine.resume()
        use_async = self.is_async and is_train
        if self.is_async:
            self.client.resume()
        if use_async:
            n_new = self.async_manager.n_new_tasks_needed()
            new_tasks = list(tasks) if tasks is not None else (self.feeder.take(n_new) if n_new > 0 else [])
            completed, async_metrics = self.async_manager.run(
                new_tasks, step=self.global_step, policy_version=self.engine.policy_version)
            metrics.update(async_metrics)
            carry = self.async_manager.carry_over_groups()
        else:
            batch_tasks = list(tasks) if tasks is not None else (
                self.feeder.take(int(self.cfg.data.train_batch_size)) if is_train else self.val_dataset)
            manager = SyncRolloutManager(
                self.client, n=int(self.cfg.actor_rollout_ref.rollout.n) if is_train else 1,
                step=self.global_step, rollout_config=self._rollout_config(), hooks=self._load_hooks(),
                timeout_seconds=float(self.cfg.agl_lab.rollout.wait_timeout_seconds),
                poll_interval=float(self.cfg.agl_lab.rollout.poll_interval_seconds))
            completed = manager.run(batch_tasks, is_train=is_train)
            carry = []
        if self.is_async:
            metrics.update(self._pause_and_drain(f"rollout_done step={self.global_step}"))
        else:
            metrics["training/n_aborted_generations"] = self.engine.abort()
        if is_train:
            metrics.update(lifecycle_metrics(completed))
        metrics["timing/rollout_phase_end_wall"] = time.time()
        metrics["timing_s/gen"] = time.time() - t0
        result = RolloutResult(step=self.global_step, rollouts=completed, metrics=metrics,
                               is_train=is_train, carry_over=carry)
        if is_train:
            self._last_rollout, self._last_batch, self._last_update = result, None, None
        return result

    def _pause_and_drain(self, reason: str) -> dict[str, float]:
        """Pause the gateway and wait (bounded) until no proxied call is in flight."""
        t0 = time.time()
        state = self.client.pause(reason=reason, retry_after_seconds=5)
        inflight_at_pause = state.inflight
        deadline = t0 + float(self.cfg.agl_lab.rollout.drain_timeout_seconds)
        while state.inflight > 0:
            if time.time() > deadline:
                raise TimeoutError(
                    f"gateway still has {state.inflight} calls in flight after "
                    f"{self.cfg.agl_lab.rollout.drain_timeout_seconds} s of draining; raise "
                    "agl_lab.rollout.drain_timeout_seconds or check the engine")
            time.sleep(0.05)
            state = self.client.proxy_state()
        return {"training/async/proxy_inflight_at_pause": inflight_at_pause,
                "training/async/proxy_drain_seconds": time.time() - t0}

    # ------------------------------------------------------------------ stage 2: build batch

    def build_batch(self, rollout: RolloutResult | None = None, **options) -> BatchResult:
        """Triplets → rows → DataProto. `options` override `build_batch` arguments (e.g. level)."""
        from agl_lab.batch import build_batch

        rollout = rollout or self._require(self._last_rollout, "trainer.rollout()")
        agl = self.cfg.agentlightning
        level = options.pop("level", str(agl.trace_aggregator.level))
        max_prompt, max_response = config_mod.trace_limits(self.cfg, level)
        kwargs = dict(level=level, max_prompt_length=max_prompt, max_response_length=max_response,
                      pad_token_id=self._pad_token_id(), reward_fillna_value=float(agl.reward_fillna_value),
                      tokenizer=self.tokenizer, multi_segment=bool(agl.trace_aggregator.multi_segment),
                      exclude_failed=bool(self.cfg.agl_lab.algorithm.exclude_failed_rollouts))
        kwargs.update(options)
        result = BatchResult(build_batch(rollout.rollouts, **kwargs), step=rollout.step)
        if rollout is self._last_rollout:
            self._last_batch = result
        return result

    def _pad_token_id(self) -> int:
        tok = self.tokenizer
        return int(tok.pad_token_id) if tok is not None and tok.pad_token_id is not None else 0

    # ------------------------------------------------------------------ stage 3: update

    def update(self, batch: BatchResult | None = None) -> UpdateResult:
        """Advantages → drops → per-rollout normalisation → policy update → weight sync."""
        from agl_lab.update import run_update

        batch = batch or self._require(self._last_batch, "trainer.build_batch()")
        t0 = time.time()
        try:  # run_update pauses the engine once it knows the step trains
            result = run_update(self.cfg, self.engine, batch, step=batch.step)
        finally:
            self.engine.resume()
        result.metrics["timing_s/update"] = time.time() - t0
        self._last_update = result
        # The step ends with the weight sync (or its skip): stage-by-stage use in a notebook
        # advances the step exactly like `step()`, so carry-over ages and logs stay right.
        self.global_step = batch.step + 1
        return result

    # ------------------------------------------------------------------ loops

    def step(self) -> dict[str, Any]:
        """rollout → build_batch → update, then log one line of metrics and advance the step."""
        t0 = time.time()
        ro = self.rollout()
        b = self.build_batch(ro)
        u = self.update(b)
        metrics = {**ro.metrics, **b.metrics, **u.metrics, "timing_s/step": time.time() - t0}
        self._log_tables(ro.step, b, "train")
        test_freq = int(self.cfg.trainer.test_freq)
        if test_freq > 0 and self.val_dataset and (ro.step + 1) % test_freq == 0:
            metrics.update(self.validate(step=ro.step))
        self.metrics_logger.log(ro.step, metrics)
        return metrics

    def _log_tables(self, step: int, result, split: str) -> None:
        """AGL v1's W&B side tables (merge breaks, compact trajectories); no-op without W&B."""
        self.metrics_logger.log_tables(step, result, split, tokenizer=self.tokenizer,
                                       reward_fillna_value=float(self.cfg.agentlightning.reward_fillna_value))

    def fit(self, steps: int | None = None, *, progress: bool = True) -> list[dict[str, Any]]:
        """Train for `steps` steps (default: `trainer.total_training_steps`, else one epoch)."""
        from tqdm.auto import tqdm

        total = steps if steps is not None else self._default_total_steps()
        history = []
        if self.cfg.trainer.val_before_train and self.val_dataset and self.global_step == 0:
            self.metrics_logger.log(self.global_step, self.validate())
        bar = tqdm(total=total, disable=not progress, desc="train", leave=False)
        for _ in range(total):
            history.append(self.step())
            bar.update(1)
        bar.close()
        return history

    def _default_total_steps(self) -> int:
        if self.cfg.trainer.total_training_steps:
            return int(self.cfg.trainer.total_training_steps)
        per_epoch = max(len(self.train_dataset) // int(self.cfg.data.train_batch_size), 1)
        return per_epoch * int(self.cfg.trainer.total_epochs)

    def validate(self, step: int | None = None) -> dict[str, Any]:
        """One rollout per validation task at the gateway's val temperature; `val/*` metrics.

        `step` (default: the current step) is the step the W&B tables are logged under.
        """
        from agl_lab.validation import build_validation

        if not self.val_dataset:
            raise ValueError("no validation tasks: set agl_lab.task.n_val > 0 or pass val_dataset")
        ro = self.rollout(self.val_dataset, is_train=False)
        val = build_validation(ro.rollouts, float(self.cfg.agentlightning.reward_fillna_value), self.tokenizer)
        self._log_tables(self.global_step if step is None else step, val, "validation")
        return {**val.metrics, **{k: v for k, v in ro.metrics.items() if k.startswith("training/async/proxy")}}

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike) -> Path:
        """Model, optimiser, RNG, data cursor and async carry-over → `path/`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.engine.save(str(path / "engine"))
        state = {
            "global_step": self.global_step,
            "feeder": self.feeder.state_dict(),
            "async": self.async_manager.state_dict() if self.async_manager else None,
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state()},
        }
        torch.save(state, path / "trainer_state.pt")
        OmegaConf.save(self.cfg, path / "config.yaml", resolve=False)  # interpolations kept
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, overrides: Sequence[str] | None = None, **kwargs) -> "Trainer":
        """A Trainer that continues exactly where `save(path)` left off."""
        path = Path(path)
        cfg = OmegaConf.load(path / "config.yaml")
        if overrides:
            layer = OmegaConf.from_dotlist(list(overrides))
            config_mod.check_unknown_keys(cfg, layer, "overrides")
            cfg = OmegaConf.merge(cfg, layer)
        config_mod.validate(cfg)
        trainer = cls(cfg, **kwargs)
        trainer.engine.load(str(path / "engine"))
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        trainer.global_step = state["global_step"]
        trainer.feeder.load_state_dict(state["feeder"])
        if trainer.async_manager and state["async"]:
            trainer.async_manager.load_state_dict(state["async"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        return trainer

    # ------------------------------------------------------------------ lifecycle

    @staticmethod
    def _require(value, producer: str):
        if value is None:
            raise RuntimeError(f"nothing to work on yet: call {producer} first (or pass a result)")
        return value

    def close(self) -> None:
        while self._closers:
            closer = self._closers.pop()
            with contextlib.suppress(Exception):
                closer()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass


# ---------------------------------------------------------------------------------------------
# `agl-lab train`
# ---------------------------------------------------------------------------------------------


def train_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="agl-lab train", description="Train from a YAML config.")
    parser.add_argument("config", help="YAML config, e.g. configs/cpu_tiny.yaml")
    parser.add_argument("--run-dir", default=None, help="where metrics.jsonl and plots go")
    parser.add_argument("--steps", type=int, default=None, help="number of steps (default: from config)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after options
    try:
        cfg = config_mod.load_config(args.config, args.overrides)
    except config_mod.ConfigError as e:
        print(f"agl-lab train: {e}")
        return 2
    t0 = time.time()
    with Trainer(cfg, run_dir=args.run_dir) as trainer:
        print(f"agl-lab train: run dir {trainer.run_dir} · engine {cfg.agl_lab.engine} · "
              f"model {trainer.engine.model_name} · task {cfg.agl_lab.task.name}", flush=True)
        history = trainer.fit(args.steps, progress=False)
        _summarise(trainer.run_dir, history, time.time() - t0)
    return 0


def _summarise(run_dir: Path, history: list[dict[str, Any]], wall: float) -> None:
    from agl_lab.viz import plot_reward_curve

    rewards = [h["training/reward"] for h in history if "training/reward" in h]
    png = plot_reward_curve(rewards, path=run_dir / "reward_curve.png")
    k = min(10, max(len(rewards) // 2, 1))
    first, last = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
    print(f"\ndone: {len(rewards)} steps in {wall / 60:.1f} min · mean training reward "
          f"first {k} steps {first:.3f} → last {k} steps {last:.3f} · curve {png} · "
          f"metrics {run_dir / 'metrics.jsonl'}", flush=True)
