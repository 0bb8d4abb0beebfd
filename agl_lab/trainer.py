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
import shutil
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

_LATEST = "latest_checkpointed_iteration.txt"  # verl's marker of the newest checkpoint


def _throughput(metrics: Mapping[str, Any]) -> dict[str, float]:
    """verl's `perf/*` step metrics (one device): tokens of the trained batch per step second."""
    tokens = float(metrics.get("perf/total_num_tokens", 0.0))
    seconds = float(metrics["timing_s/step"])
    return {"perf/total_num_tokens": tokens, "perf/time_per_step": seconds,
            "perf/throughput": tokens / seconds if seconds > 0 else 0.0}


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
        task: Any = None,
        train_dataset: Sequence[dict] | None = None,
        val_dataset: Sequence[dict] | None = None,
        run_dir: str | os.PathLike | None = None,
        console: bool = True,
    ):
        self.cfg = cfg
        lab = cfg.agl_lab
        seed_everything(int(lab.seed))
        self.global_step = 0  # steps done = verl's 1-based global_steps of the last step
        self._last_step: int | None = None  # the last step of the running `fit`
        self._resumed = False
        self._closers: list[Callable[[], None]] = []
        self._last_rollout: RolloutResult | None = None
        self._last_batch: BatchResult | None = None
        self._last_update: UpdateResult | None = None

        self._closed = False
        self.task = None
        train_files, val_files = config_mod.task_files(cfg)
        if agent is None and lab.get("agent"):
            agent = load_agent(str(lab.agent))  # `agl_lab.agent=module:function` (CLI)
        if isinstance(agent, type):
            agent = agl_agent_class_spec(agent)  # an AGL agent class: Class().run() in a subprocess
        # The task (given, else the configured built-in one) supplies the agent and/or the tasks
        # that nothing else supplies.
        if task is not None or (not cfg.agentlightning.local.agent_class and (
                agent is None or (train_dataset is None and train_files is None))):
            from agl_lab.tasks import get_task

            self.task = get_task(task if task is not None else str(lab.task.name))
        if agent is None and self.task is not None and not cfg.agentlightning.local.agent_class:
            agent = self.task.agent
        self.agent = agent
        self.train_dataset, self.val_dataset = self._datasets(train_dataset, val_dataset, train_files, val_files)
        self.feeder = TaskFeeder(self.train_dataset, seed=int(lab.seed), shuffle=bool(cfg.data.shuffle))

        try:
            self.engine = engine if engine is not None else self._make_engine()
            self._start_execution_side()
        except BaseException:
            self.close()
            raise
        self.run_dir = Path(run_dir or lab.run_dir or self._default_run_dir())
        console_on, wandb_mode = config_mod.loggers(cfg)
        self.metrics_logger = MetricsLogger(
            self.run_dir, console=console and console_on, wandb_mode=wandb_mode,
            project=str(cfg.trainer.project_name), experiment=str(cfg.trainer.experiment_name),
            config=config_mod.to_container(cfg))
        self._closers.append(self.metrics_logger.close)
        OmegaConf.save(cfg, self.run_dir / "config.yaml", resolve=False)  # what this run was asked to do
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

    def _datasets(self, train, val, train_files, val_files) -> tuple[list[dict], list[dict]]:
        """Explicit datasets, else `data.train_files`/`val_files`, else the built-in task's."""
        from agl_lab.data import load_task_files

        lab, columns = self.cfg.agl_lab, config_mod.env_map_columns(self.cfg)
        if train is None and train_files is not None:
            train = load_task_files(train_files, "data.train_files", columns)
        if val is None and val_files is not None:
            val = load_task_files(val_files, "data.val_files", columns)
        if train is None and self.task is None:
            raise config_mod.ConfigError(
                "agentlightning.local.agent_class is set but there are no tasks to run it on: set "
                "data.train_files (parquet or JSONL) or pass Trainer(..., train_dataset=[{...}, ...])")
        if train is None:
            train = self.task.train_tasks(int(lab.task.n_train), seed=int(lab.seed))
        if val is None:
            val = self.task.val_tasks(int(lab.task.n_val), seed=int(lab.seed) + 1) if self.task else []
        return list(train), list(val)

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
            from agl_lab.engines.verl.engine import VerlEngine

            if lab.model.path is None:  # verl's workers load from disk: the tiny model, warm-started like local's
                from agl_lab.tasks.warmstart import warm_started_model_dir

                steps = int(lab.model.warm_start_steps) if self.task is not None else 0
                lab.model.path = str(warm_started_model_dir(
                    self.task.name if self.task else "", steps, seed=int(lab.seed)))
            engine = VerlEngine(self.cfg, train_dataset=self.train_dataset, val_dataset=self.val_dataset)
            self._closers.append(engine.close)  # its workers, replicas and the Ray cluster it started
            return engine
        from agl_lab.engines.local import LocalEngine
        from agl_lab.quiet import quiet_hf

        preset = lab.model.get("preset")
        label = lab.model.path or (f"preset {preset} (converted once into {_cache_hint()})" if preset
                                   else f"built-in tiny model (cached in {_cache_hint()})")
        with quiet_hf(), _stage(f"model: {label}"):
            engine = LocalEngine.from_config(self.cfg)
        self._closers.append(engine.close)
        if self.task is not None and int(lab.model.warm_start_steps) > 0 and lab.model.path is None \
                and lab.model.get("preset") is None:
            from agl_lab.tasks.warmstart import warm_start

            if self.task.demo_transcripts is None:
                logger.warning("task %r has no demonstrations: agl_lab.model.warm_start_steps=%s has no "
                               "effect (give Task(demonstrations=...) for a warm start)",
                               self.task.name, lab.model.warm_start_steps)
            else:
                warm_start(engine.model, engine.tokenizer, self.task,
                           steps=int(lab.model.warm_start_steps), seed=int(lab.seed), progress=True)
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
                **config_mod.server_overrides(self.cfg),  # lease_seconds, upstream_* …: ServerConfig's defaults if unset
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
            timeout_seconds=config_mod.rollout_wait_timeout(self.cfg),
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

        self._check_open("rollout()")
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
                timeout_seconds=config_mod.rollout_wait_timeout(self.cfg),
                poll_interval=float(self.cfg.agl_lab.rollout.poll_interval_seconds))
            completed = manager.run(batch_tasks, is_train=is_train)
            carry = []
        if self.is_async:
            metrics.update(self._pause_and_drain(f"rollout_done step={self.global_step}"))
        else:
            metrics["training/n_aborted_generations"] = self.engine.abort()
        if is_train:
            metrics.update(lifecycle_metrics(completed))
        metrics.update(_report_failures(completed, self.global_step, is_train))
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

    def update(self, batch: BatchResult | None = None, *, allow_reuse: bool = False) -> UpdateResult:
        """Advantages → drops → per-rollout normalisation → policy update → weight sync.

        A batch trains once: updating on a batch that was already used (a re-run notebook
        cell) would train off-policy, so it raises unless `allow_reuse=True`.
        """
        from agl_lab.update import run_update

        self._check_open("update()")
        batch = batch or self._require(self._last_batch, "trainer.build_batch()")
        if batch.updated_to_version is not None and not allow_reuse:
            raise RuntimeError(
                f"this batch (step {batch.step}) was already used for an update (→ policy version "
                f"{batch.updated_to_version}); updating on it again trains off-policy. Run "
                "trainer.rollout() and trainer.build_batch() for a fresh batch, or pass "
                "update(allow_reuse=True) if you mean it.")
        t0 = time.time()
        try:  # run_update pauses the engine once it knows the step trains
            result = run_update(self.cfg, self.engine, batch, step=batch.step)
        finally:
            self.engine.resume()
        result.metrics["timing_s/update"] = time.time() - t0
        if not result.skipped:
            batch.updated_to_version = result.policy_version
        self._last_update = result
        # The step ends with the weight sync (or its skip): stage-by-stage use in a notebook
        # advances the step exactly like `step()`, so carry-over ages and logs stay right.
        self.global_step = batch.step + 1
        return result

    # ------------------------------------------------------------------ loops

    def step(self) -> dict[str, Any]:
        """rollout → build_batch → update, then validate/checkpoint when due and log one line.

        Metrics are logged at verl's 1-based `global_steps` (= `self.global_step` after the
        update). Validation runs when `trainer.test_freq` divides the step or it is the last
        step of `fit`; a checkpoint is saved likewise for `trainer.save_freq`.
        """
        t0 = time.time()
        ro = self.rollout()
        b = self.build_batch(ro)
        u = self.update(b)
        step_no = self.global_step
        metrics = {**ro.metrics, **b.metrics, **u.metrics, "timing_s/step": time.time() - t0}
        metrics.update(_throughput(metrics))
        self._log_tables(step_no, b, "train")
        last = self._last_step is not None and step_no >= self._last_step
        test_freq, save_freq = int(self.cfg.trainer.test_freq), int(self.cfg.trainer.save_freq)
        if test_freq > 0 and self.val_dataset and (last or step_no % test_freq == 0):
            t1 = time.time()
            metrics.update(self.validate(step=step_no))
            metrics["timing_s/validate"] = time.time() - t1
        if save_freq > 0 and (last or step_no % save_freq == 0):
            t1 = time.time()
            self.save_checkpoint()
            metrics["timing_s/save_checkpoint"] = time.time() - t1
        self.metrics_logger.log(step_no, metrics)
        return metrics

    def _log_tables(self, step: int, result, split: str) -> None:
        """AGL v1's W&B side tables (merge breaks, compact trajectories); no-op without W&B."""
        self.metrics_logger.log_tables(step, result, split, tokenizer=self.tokenizer,
                                       reward_fillna_value=float(self.cfg.agentlightning.reward_fillna_value))

    def fit(self, steps: int | None = None, *, progress: bool = True) -> list[dict[str, Any]]:
        """Train until step `trainer.total_training_steps` (else `total_epochs` epochs), or for
        `steps` more steps. Resumes first per `trainer.resume_mode`; validates first when
        `trainer.val_before_train` (and only, when `trainer.val_only`)."""
        from tqdm.auto import tqdm

        self._check_open("fit()")
        self.resume()
        total = self.global_step + steps if steps is not None else self._default_total_steps()
        self._last_step = total
        history: list[dict[str, Any]] = []
        if (self.cfg.trainer.val_before_train or self.cfg.trainer.val_only) and self.val_dataset:
            val = self.validate(step=self.global_step)
            self.metrics_logger.log(self.global_step, val)
            history.append(val)
            if self.cfg.trainer.val_only:
                return history
        bar = tqdm(total=total, initial=self.global_step, disable=not progress, desc="train", leave=False)
        while self.global_step < total:
            history.append(self.step())
            bar.update(1)
        bar.close()
        self.plot_metrics(self.run_dir / "reward_curve.png")
        return history

    @property
    def metrics(self):
        """Every logged step of this run as a DataFrame indexed by step (a validation logged
        before training shares its step's row). Stages run one by one are not logged."""
        import pandas as pd

        history = self.metrics_logger.history
        return pd.DataFrame(history).groupby("step").last() if history else pd.DataFrame()

    def plot_metrics(self, path: str | os.PathLike | None = None):
        """Training reward per step (and validation reward where validation ran); saves a PNG
        when `path` is given and returns its Path, else returns the Axes; None before the
        first step."""
        from agl_lab.viz import plot_reward_curve

        df = self.metrics
        if "training/reward" not in df:
            return None
        train = df["training/reward"].dropna()
        val = df["val/reward"].dropna() if "val/reward" in df else None
        return plot_reward_curve(train.to_numpy(), steps=train.index.to_numpy(), path=path,
                                 val=None if val is None or val.empty else val.to_dict(),
                                 window=max(1, min(10, len(train) // 3)))

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

        self._check_open("validate()")
        if not self.val_dataset:
            raise ValueError("no validation tasks: set agl_lab.task.n_val > 0 or pass val_dataset")
        repeat = int(self.cfg.actor_rollout_ref.rollout.val_kwargs.n)  # verl interleaves the copies
        tasks = [t for t in self.val_dataset for _ in range(max(repeat, 1))]
        ro = self.rollout(tasks, is_train=False)
        val = build_validation(ro.rollouts, float(self.cfg.agentlightning.reward_fillna_value), self.tokenizer)
        self._log_tables(self.global_step if step is None else step, val, "validation")
        return {**val.metrics, **{k: v for k, v in ro.metrics.items() if k.startswith("training/async/proxy")}}

    def dry_run(self, task: dict | None = None, *, show: bool = True):
        """Run the agent once on `task` (default: the first validation task, else the first
        training task) and print its transcript: each call's new prompt tokens, the reply,
        token counts, the reward and any error. Nothing is trained; the step does not advance.

        Runs in validation mode (n=1, the gateway's `val_temperature`). Returns the
        `CompletedRollout` (its `.triplets`, `.final_reward`, `.error_message`).
        """
        from agl_lab.transcript import format_transcript

        self._check_open("dry_run()")
        if task is None:
            pool = self.val_dataset or self.train_dataset
            if not pool:
                raise ValueError("dry_run(): no task given and the trainer has no tasks")
            task = pool[0]
        ro = self.rollout([task], is_train=False)
        rollout = ro.rollouts[0]
        if show:
            print(format_transcript(rollout, self.tokenizer), flush=True)
        return rollout

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
        trainer.restore(path)
        return trainer

    def restore(self, path: str | os.PathLike) -> None:
        """Load `save(path)` into this Trainer: weights, optimiser, RNG, data cursor, carry-over."""
        path = Path(path)
        self.engine.load(str(path / "engine"))
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        self.global_step = state["global_step"]
        self.feeder.load_state_dict(state["feeder"])
        if self.async_manager and state["async"]:
            self.async_manager.load_state_dict(state["async"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        self._resumed = True

    @property
    def checkpoint_root(self) -> Path:
        """`trainer.default_local_dir` (verl: checkpoints/{project}/{experiment})."""
        return Path(str(self.cfg.trainer.default_local_dir)).expanduser()

    def save_checkpoint(self) -> Path:
        """`save()` to `default_local_dir/global_step_N` atomically, then mark it the latest
        (`latest_checkpointed_iteration.txt`, as verl)."""
        root = self.checkpoint_root
        final = root / f"global_step_{self.global_step}"
        tmp = root / f".global_step_{self.global_step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.save(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # Critical: a killed save never leaves a half checkpoint under the real name
        (root / _LATEST).write_text(str(self.global_step))
        return final

    def resume(self) -> Path | None:
        """Resume once per `trainer.resume_mode`: `auto` (latest checkpoint under
        `default_local_dir`, none → start fresh), `resume_path` (`trainer.resume_from_path`),
        `disable`. Returns the checkpoint loaded, if any."""
        mode = str(self.cfg.trainer.resume_mode)
        if self._resumed or mode == "disable" or self.global_step > 0:
            return None
        if mode == "resume_path":
            path = self.cfg.trainer.resume_from_path
            if not path or not (Path(str(path)) / "trainer_state.pt").exists():
                raise config_mod.ConfigError(
                    f"trainer.resume_mode=resume_path needs trainer.resume_from_path to be a checkpoint "
                    f"directory (…/global_step_N), got {path!r}")
            path = Path(str(path))
        elif mode == "auto":
            latest = self.checkpoint_root / _LATEST
            if not latest.exists():
                return None
            path = self.checkpoint_root / f"global_step_{int(latest.read_text().strip())}"
        else:
            raise config_mod.ConfigError(f"trainer.resume_mode={mode!r} is not one of auto, resume_path, disable")
        self.restore(path)
        logger.info("resumed from %s at step %d", path, self.global_step)
        return path

    # ------------------------------------------------------------------ lifecycle

    @staticmethod
    def _require(value, producer: str):
        if value is None:
            raise RuntimeError(f"nothing to work on yet: call {producer} first (or pass a result)")
        return value

    def _check_open(self, what: str) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError(f"this Trainer is closed (its engine, gateway and runner are stopped), so "
                               f"{what} cannot run; create a new Trainer (Trainer.from_config(...)). "
                               "Results you already have (rollouts, batches, trainer.metrics) stay readable.")

    def __repr__(self) -> str:
        cfg = self.cfg
        engine = getattr(self, "engine", None)
        task = self.task.name if self.task is not None else getattr(self.agent, "__name__", self.agent)
        parts = [f"engine={cfg.agl_lab.engine}",
                 f"model={getattr(engine, 'model_name', None) if engine is not None else None}",
                 f"task={task}", f"step={self.global_step}",
                 f"policy_version={getattr(engine, 'policy_version', None)}",
                 f"run_dir={str(getattr(self, 'run_dir', None))!r}"]
        if getattr(self, "_closed", False):
            parts.append("closed")
        return f"Trainer({', '.join(parts)})"

    def close(self) -> None:
        self._closed = True
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


def _report_failures(completed, step: int, is_train: bool) -> dict[str, Any]:
    """`training/n_failed_rollouts` (`val/…`) and, when any failed, one warning with the count
    and the first error message."""
    failed = [r for r in completed if r.state == "failed"]
    if failed:
        first = (failed[0].error_message or "no error message").strip()
        logger.warning("step %d: %d of %d %s rollouts failed; first error (rollout %s): %s\n"
                       "(every error: RolloutResult.lifecycle[['rollout_id', 'state', 'error_message']])",
                       step, len(failed), len(completed), "training" if is_train else "validation",
                       failed[0].rollout_id, first[:2000])
    return {f"{'training' if is_train else 'val'}/n_failed_rollouts": len(failed)}


def load_agent(spec: str) -> Callable:
    """The callable named by `"module:function"` (`agl_lab.agent=...` on the command line).

    A name that is not a function (a class, an AGL agent class) is returned as the string, for
    the runner to run as an AGL agent subprocess."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"agl_lab.agent={spec!r} must be 'module:function' (e.g. my_agents:solve), "
                         "importable from the current directory or PYTHONPATH")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"agl_lab.agent={spec!r}: {obj.__name__!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        return spec  # a class: run as an AGL agent (Class().run()) in a subprocess
    if not callable(obj):
        raise ValueError(f"agl_lab.agent={spec!r} names a {type(obj).__name__}, not a function agent(task, ctx)")
    return obj


def agl_agent_class_spec(cls: type) -> str:
    """`"module:Qualname"` of an Agent Lightning agent class (no-argument constructor, `run()`),
    which the runner starts in a subprocess per rollout with `AGL_OPENAI_BASE_URL`,
    `AGL_EVENT_URL` and `AGL_KEY` set — the AGL v1 contract, so the class runs unchanged."""
    if not callable(getattr(cls, "run", None)):
        raise TypeError(f"agent={cls.__name__} is a class without run(): pass a function agent(task, ctx), "
                        "or an Agent Lightning agent class (no-argument constructor and run())")
    if cls.__module__ in ("__main__", "builtins") or "<locals>" in cls.__qualname__:
        raise TypeError(f"agent={cls.__name__}: an Agent Lightning agent class runs in a subprocess, which "
                        "imports it by name; define it in a module (not in a notebook cell or a function), "
                        "or write the agent as a function agent(task, ctx)")
    return f"{cls.__module__}:{cls.__qualname__}"


def _cache_hint() -> str:
    from agl_lab.engines.tiny import cache_root

    return str(cache_root()).replace(str(Path.home()), "~")


@contextlib.contextmanager
def _stage(description: str):
    """A one-step progress bar naming long first-run work (model build/load)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=1, desc=description, leave=False, bar_format="{desc} {elapsed}")
    try:
        yield
    finally:
        bar.update(1)
        bar.close()


# ---------------------------------------------------------------------------------------------
# `agl-lab train`
# ---------------------------------------------------------------------------------------------


def train_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="agl-lab train", description="Train from a YAML config.")
    parser.add_argument("config", help="YAML config, e.g. configs/cpu_tiny.yaml")
    parser.add_argument("--run-dir", default=None, help="where metrics.jsonl and plots go")
    parser.add_argument("--steps", type=int, default=None, help="number of steps (default: from config)")
    parser.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
                        help="continue from the latest checkpoint under trainer.default_local_dir, "
                             "or from CHECKPOINT (…/global_step_N)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after options
    overrides = list(args.overrides)
    if args.resume == "auto":
        overrides.append("trainer.resume_mode=auto")
    elif args.resume is not None:
        overrides += ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={args.resume}"]
    try:
        cfg = config_mod.load_config(args.config, overrides)
    except config_mod.ConfigError as e:
        print(f"agl-lab train: {e}")
        return 2
    t0 = time.time()
    with Trainer(cfg, run_dir=args.run_dir) as trainer:
        print(f"agl-lab train: run dir {trainer.run_dir} · engine {cfg.agl_lab.engine} · "
              f"model {trainer.engine.model_name} · task {cfg.agl_lab.task.name}", flush=True)
        resumed = trainer.resume()
        if resumed is not None:
            print(f"agl-lab train: resumed from {resumed} at step {trainer.global_step}", flush=True)
        history = trainer.fit(args.steps, progress=False)
        _summarise(trainer.run_dir, history, time.time() - t0)
    return 0


def _summarise(run_dir: Path, history: list[dict[str, Any]], wall: float) -> None:
    rewards = [h["training/reward"] for h in history if "training/reward" in h]
    if not rewards:
        print(f"\ndone: no training steps in {wall / 60:.1f} min · metrics {run_dir / 'metrics.jsonl'}", flush=True)
        return
    png = run_dir / "reward_curve.png"  # written by fit()
    k = min(10, max(len(rewards) // 2, 1))
    first, last = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
    print(f"\ndone: {len(rewards)} steps in {wall / 60:.1f} min · mean training reward "
          f"first {k} steps {first:.3f} → last {k} steps {last:.3f} · curve {png} · "
          f"metrics {run_dir / 'metrics.jsonl'}", flush=True)
