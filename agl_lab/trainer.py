"""The stepwise Trainer: the agentic GRPO loop, one stage per call, for a notebook cell each.

    trainer = Trainer.from_config("configs/cpu_tiny.yaml", overrides=["data.train_batch_size=8"])
    ro = trainer.rollout()       # agents run through the gateway → completed rollouts
    b  = trainer.build_batch()   # triplets → rows → verl DataProto (+ rows/breaks/groups views)
    u  = trainer.update()        # advantages → drops → per-rollout loss → policy update → sync

Each stage uses the previous stage's result by default and accepts an explicit one, so a
notebook can rebuild a batch from the same rollouts with other settings. `step()` runs the
three, `fit()` loops, `validate()` runs one rollout per validation task. This module holds the
loop only: the engine comes from `agl_lab.engines.build`, the server, client, runner and hooks
from `agl_lab.execution`, and `agl-lab train` is in `agl_lab.cli`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from agl_lab import checkpoints, runs, watch
from agl_lab import config as config_mod
from agl_lab.data import TaskFeeder
from agl_lab.logger import MetricsLogger, throughput_metrics
from agl_lab.results import BatchResult, RolloutResult, UpdateResult, report_rollout_problems

logger = logging.getLogger(__name__)


class Trainer:
    """Agentic GRPO, one stage per call.

    Args:
        cfg: a composed config (`agl_lab.config.load_config`; `Trainer.from_config` composes one).
        engine: an `Engine` to train (default: built from `agl_lab.engine`; a given engine is not
            closed by the Trainer).
        agent: `agent(task, ctx) -> reward | None`, a `"module:function"` string, or an Agent
            Lightning agent class (run in a subprocess). Default: `agl_lab.agent`, else the task's.
        task: a `Task` or a registered task name; supplies the agent and/or the datasets that
            nothing else supplies (default: `agl_lab.task.name`).
        train_dataset, val_dataset: lists of task dicts (default: `data.train_files` /
            `data.val_files`, else the task's generators).
        run_dir: where `config.yaml`, `metrics.jsonl` and plots go (default `runs/<experiment>-<time>`).
        console: print one line per step (also `trainer.logger` in the config).

    Example:
        >>> with Trainer.from_config("configs/cpu_tiny.yaml", overrides=["trainer.total_training_steps=3"]) as t:
        ...     ro = t.rollout(); b = t.build_batch(); u = t.update()
        ...     b.rows.head(); u.weights.head()          # DataFrames: rows, loss weight per rollout
        ...     t.fit()                                  # the remaining steps, validation, checkpoints

    One step, hop by hop (module:function):
        1. `rollout()`
           a. `execution:Execution.serving` registers the engine's endpoints with the store
              (`client:AglClient.register_models`) under its `policy_version`; `engine.resume()`.
           b. `rollout:SyncRolloutManager.run` (or `AsyncRolloutManager.run`, which carries slow
              groups over) creates `n` rollouts per task (`client:AglClient.create_rollouts`).
           c. `runner:Runner._tick` claims each queued rollout (`Runner._claim`) and runs the agent
              (`Runner._launch`); its OpenAI calls go through `server.gateway:Gateway.handle`, which forwards them to the
              engine's OpenAI server and records token ids + logprobs as `model_request` events.
           d. the managers follow the store's terminal log (`client:AglClient.poll_terminal`) and
              turn each finished rollout's events into triplets
              (`records:events_to_completed_rollout`).
           e. the phase ends (`phases:rollout_phase`, also when collecting raises): sync mode aborts
              stray generations (`engine.abort()`), async mode drains the gateway (`phases:drain_gateway`).
        2. `build_batch()`: `batch:build_batch` merges each rollout's triplets into rows by exact
           token prefix (`batch:plan_rows`; a mismatch is a merge break, `diagnose` explains it),
           masks observations out of the loss, pads (`padding:pad_rows`) and emits a DataProto.
        3. `update()`: `update:run_update`
           a. `algorithms.selection:skip_reason` decides from row counts whether the step trains;
           b. `engine.pause()` (`phases:update_phase`), then `engine.prepare(batch)`: old logprobs (+ ref/KL/IS on verl);
           c. `algorithms.pipeline:prepare_update_batch`: marked rows dropped, one advantage per
              rollout (`algorithms.advantage:compute_advantages`), whole mini-batches with
              zero-advantage groups dropped first (`algorithms.selection:select_for_update`),
              equal loss weight per rollout (`algorithms.loss:normalize_batch`);
           d. `engine.update(batch)` (PPO epochs with the `per_rollout_mean` loss; the local
              engine's step is `engines.local_ppo:ppo_step`), `engine.sync_weights()`
              (policy_version + 1), `engine.resume()`.
        4. `step()` adds validation (`trainer.test_freq`), checkpoints (`trainer.save_freq`)
           and one line in `metrics.jsonl` (`logger:MetricsLogger.log`).
    """

    def __init__(
        self,
        cfg,
        *,
        engine=None,
        agent: Callable | str | type | None = None,
        task: Any = None,
        train_dataset: Sequence[dict] | None = None,
        val_dataset: Sequence[dict] | None = None,
        run_dir: str | os.PathLike | None = None,
        console: bool = True,
    ):
        from agl_lab.algorithms.credit import unused_turn_credit_at_load
        from agl_lab.data import resolve_datasets
        from agl_lab.tasks import agent_and_task

        self.cfg = cfg
        lab = cfg.agl_lab
        checkpoints.seed_everything(int(lab.seed))
        self.global_step = 0  # steps done = verl's 1-based global_steps of the last step
        self._last_step: int | None = None  # the last step of the running `fit`
        self._resumed = self._closed = False
        self._closers: list[Callable[[], None]] = []
        self._last_rollout: RolloutResult | None = None
        self._last_batch: BatchResult | None = None
        self._last_update: UpdateResult | None = None
        self._saved: list[Path] = []  # checkpoints this Trainer saved (trainer.max_actor_ckpt_to_keep prunes them)

        train_files, val_files = config_mod.task_files(cfg)
        self.agent, self.task = agent_and_task(
            cfg, agent, task, has_tasks=train_dataset is not None or train_files is not None
        )
        self._task_name = self.task.name if self.task is not None else str(lab.task.name)
        own_agent = self.task is not None and (self.agent is self.task.agent or self.agent in self.task.agents.values())
        if message := unused_turn_credit_at_load(str(lab.algorithm.turn_credit), self._task_name, own_agent):
            logger.warning(message)
        self._turn_credit_warned = False  # the first step whose rollouts carry no turn reward warns once
        self.train_dataset, self.val_dataset = resolve_datasets(
            cfg, self.task, train_dataset, val_dataset, train_files, val_files
        )
        self.feeder = TaskFeeder(self.train_dataset, seed=int(lab.seed), shuffle=bool(cfg.data.shuffle))
        config_mod.check_validation_tasks(cfg, len(self.val_dataset or []))

        self._reward_watch = watch.for_run(cfg, self.task, engine_given=engine is not None)
        try:
            if engine is None:
                from agl_lab.engines.build import build_engine

                engine = build_engine(
                    cfg, task=self.task, train_dataset=self.train_dataset, val_dataset=self.val_dataset
                )
                self._closers.append(engine.close)  # verl: its workers, replicas and the Ray cluster it started
            self.engine = engine
            from agl_lab.execution import Execution

            self.execution = Execution(cfg, engine=engine, agent=self.agent)
            self._closers.append(self.execution.close)
        except BaseException:
            self.close()
            raise
        self.run_dir = Path(run_dir or lab.run_dir or self._default_run_dir())
        self.metrics_logger = MetricsLogger.for_run(cfg, self.run_dir, console=console)  # trainer.logger
        self._closers.append(self.metrics_logger.close)
        OmegaConf.save(config_mod.redact_secrets(cfg), self.run_dir / "config.yaml")  # asked for, less secrets
        from agl_lab.recording import Recorder

        self.recorder = Recorder(self.run_dir, lab.record)  # every step, replayable (agl_lab.recording, agl_lab.replay)
        self.async_manager = None
        if self.is_async:
            from agl_lab.rollout import AsyncRolloutManager

            self.async_manager = AsyncRolloutManager(
                self.client,
                n=int(cfg.actor_rollout_ref.rollout.n),
                train_batch_size=int(cfg.data.train_batch_size),
                async_train_batch_size=cfg.agentlightning.async_rollout.async_train_batch_size,
                max_staleness=int(cfg.agl_lab.rollout.max_staleness),
                **self.execution.manager_args(),
            )

    @classmethod
    def from_config(
        cls, path=None, overrides: Sequence[str] | Mapping | None = None, engine: str | None = None, **kwargs
    ) -> Trainer:
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

    # The execution side's pieces, for a notebook that wants to look at the store directly.
    client = property(lambda self: self.execution.client, doc="the AglClient on the store/gateway")
    server = property(lambda self: self.execution.server, doc="the embedded server, or None (external)")
    runner = property(lambda self: self.execution.runner, doc="the Runner executing agents, or None")
    base_url = property(lambda self: self.execution.base_url, doc="the store/gateway URL")
    key = property(lambda self: self.execution.key, doc="the admin key of the store/gateway")

    def _default_run_dir(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return Path("runs") / f"{self.cfg.trainer.experiment_name}-{stamp}"

    # ------------------------------------------------------------------ stage 1: rollout

    def rollout(self, tasks: Sequence[dict] | None = None, *, is_train: bool = True) -> RolloutResult:
        """Run the agents on the next batch of tasks (n rollouts each) and collect them.

        Sync mode waits for every rollout, then aborts stray generations; async mode
        completes when `train_batch_size` whole groups are done and carries the rest over.
        """
        from agl_lab.rollout import finish_collected

        self._check_open("rollout()")
        t0 = time.time()
        with self.execution.serving(
            self.engine, drain=self.is_async, reason=f"rollout_done step={self.global_step}"
        ) as metrics:
            metrics["timing/step_start_wall"] = t0
            if self.async_manager is not None and is_train:
                completed, carry = self._collect_async(tasks, metrics)
            else:
                completed, carry = self._collect_sync(tasks, is_train, metrics), []
        metrics.update(
            finish_collected(
                completed,
                vocab_size=self.engine.vocab_size,
                max_abs_reward=float(self.cfg.agl_lab.algorithm.max_abs_reward),
                step=self.global_step + 1 if is_train else self.global_step,  # as the console numbers it
                is_train=is_train,
            )
        )
        metrics["timing/rollout_phase_end_wall"] = time.time()
        metrics["timing_s/gen"] = time.time() - t0
        result = RolloutResult(
            step=self.global_step,
            rollouts=completed,
            metrics=metrics,
            is_train=is_train,
            carry_over=carry,
            tokenizer=self.tokenizer,
        )
        if is_train:
            self._last_rollout, self._last_batch, self._last_update = result, None, None
            self._reward_watch.observe_rollouts(self.global_step + 1, completed)
        return result

    def _collect_sync(self, tasks: Sequence[dict] | None, is_train: bool, metrics: dict[str, Any]) -> list:
        """Every rollout of this batch (n per task; one per validation task)."""
        from agl_lab.rollout import SyncRolloutManager

        if tasks is None:
            tasks = self.feeder.take(int(self.cfg.data.train_batch_size)) if is_train else self.val_dataset
        manager = SyncRolloutManager(
            self.client,
            n=int(self.cfg.actor_rollout_ref.rollout.n) if is_train else 1,
            step=self.global_step,
            **self.execution.manager_args(),
        )
        return manager.run(list(tasks), is_train=is_train, metrics=metrics)

    def _collect_async(self, tasks: Sequence[dict] | None, metrics: dict[str, Any]) -> tuple[list, list]:
        """`train_batch_size` whole groups, the rest carried over to the next step."""
        if self.execution.max_staleness:  # overlap: stale groups go before the top-up replaces them
            self.async_manager.drop_stale(self.engine.serving_version, self.execution.max_staleness)
        if tasks is None:
            n_new = self.async_manager.n_new_tasks_needed()
            tasks = self.feeder.take(n_new) if n_new > 0 else []
        overlap = self.execution.max_staleness
        if not overlap:  # the synchronous loop, as it always was
            completed, async_metrics = self.async_manager.run(
                list(tasks), step=self.global_step, policy_version=self.engine.policy_version
            )
        else:  # docs/engines.md "Overlap": stale groups go first; the next step's groups start now
            version = self.engine.serving_version
            completed, async_metrics = self.async_manager.run(
                list(tasks),
                step=self.global_step,
                policy_version=version,
                max_staleness=overlap,
                stale_groups=self.execution.stale_groups,
            )
            n_next = self.async_manager.n_new_tasks_needed()
            self.async_manager.prefetch(self.feeder.take(n_next) if n_next > 0 else [], self.global_step + 1, version)
        metrics.update(async_metrics)
        return completed, self.async_manager.carry_over_groups()

    # ------------------------------------------------------------------ stage 2: build batch

    def build_batch(self, rollout: RolloutResult | None = None, **options) -> BatchResult:
        """Triplets → rows → DataProto. `options` override `build_batch` arguments (e.g. level)."""
        from agl_lab.algorithms.credit import unused_turn_credit_at_step
        from agl_lab.batch import build_batch

        rollout = rollout or self._require(self._last_rollout, "trainer.rollout()")
        kwargs = dict(
            config_mod.batch_options(self.cfg, options.pop("level", None)),
            pad_token_id=self._pad_token_id(),
            tokenizer=self.tokenizer,
        )
        built = build_batch(rollout.rollouts, **{**kwargs, **options})
        n_without = int(built.metrics.get("training/turn_credit/n_rollouts_without_turn_rewards", 0))
        if n_without and not self._turn_credit_warned:  # one line naming the task, at the first step that shows it
            n_rollouts = sum(bool(r.triplets) for r in rollout.rollouts)  # the rollouts the count looked at
            logger.warning(unused_turn_credit_at_step(self._task_name, self.global_step + 1, n_without, n_rollouts))
            self._turn_credit_warned = True
        result = report_rollout_problems(BatchResult(built, step=rollout.step, tokenizer=self.tokenizer))
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
                "update(allow_reuse=True) if you mean it."
            )
        t0 = time.time()
        result = run_update(self.cfg, self.engine, batch, step=batch.step)
        result.metrics["timing_s/update"] = time.time() - t0
        if self.execution.max_staleness:  # overlap: the trained weights reach the server now
            result.metrics.update(self.execution.publish(self.engine, step=batch.step))
        if not result.skipped:
            batch.updated_to_version = result.policy_version
        self._last_update = result
        # The step ends with the weight sync (or its skip): stage-by-stage use in a notebook
        # advances the step exactly like `step()`, so carry-over ages and logs stay right.
        self.global_step = batch.step + 1
        return result

    def tokens(self, row: Any, result: UpdateResult | BatchResult | None = None):
        """Per-token logprobs, ratio, entropy, loss mask and advantage of one row (`agl_lab.token_view`)
        of `result` (default: the last update). A BatchResult not yet updated on: old logprob
        and ratio NaN, new logprob and entropy of the current policy."""
        from agl_lab.token_view import find_row, row_key, tokens_frame

        result = result or self._require(self._last_update, "trainer.update()")
        if isinstance(result, UpdateResult):
            return result.tokens(row)
        temperature = float(self.cfg.actor_rollout_ref.rollout.temperature)
        i = find_row(result.data, *row_key(row, result.data))
        return tokens_frame(result.data, i, self.engine, result.tokenizer, temperature=temperature)

    # ------------------------------------------------------------------ loops

    def step(self) -> dict[str, Any]:
        """rollout → build_batch → update, then validate/checkpoint when due and log one line.

        Metrics are logged at verl's 1-based `global_steps` (= `self.global_step` after the
        update). Validation runs when `trainer.test_freq` divides the step or it is the last
        step of `fit`; a checkpoint is saved likewise for `trainer.save_freq`.
        """
        t0, rng, serving = time.time(), checkpoints.rng_state(), self.engine.policy_version
        ro = self.rollout()
        b = self.build_batch(ro)
        u = self.update(b)
        step_no = self.global_step
        metrics = {**ro.metrics, **b.metrics, **u.metrics, "timing_s/step": time.time() - t0}
        metrics.update(throughput_metrics(metrics))
        self._log_tables(step_no, b, "train")
        last = self._last_step is not None and step_no >= self._last_step
        test_freq, save_freq = int(self.cfg.trainer.test_freq), int(self.cfg.trainer.save_freq)
        if test_freq > 0 and self.val_dataset and (last or step_no % test_freq == 0):
            metrics.update(self.validate(step=step_no))
        with runs.step_end():  # a stop signal waits: a checkpoint never lands without its metrics line
            if save_freq > 0 and (last or step_no % save_freq == 0):
                t1 = time.time()
                self.save_checkpoint()
                metrics["timing_s/save_checkpoint"] = time.time() - t1
            metrics["recording/bytes"] = self.recorder.record(
                step_no,
                batch_step=b.step,
                rollouts=ro.rollouts,
                metrics=metrics,
                update=u,
                policy_version=serving,
                seed=int(self.cfg.agl_lab.seed),
                rng=rng,
                pad_token_id=self._pad_token_id(),
            )
            metrics["recording/failed"] = float(self.recorder.last_failed)  # a warning, never a dead run
            self.metrics_logger.log(step_no, metrics)
        return metrics

    def _log_tables(self, step: int, result, split: str) -> None:
        """AGL v1's W&B side tables (merge breaks, compact trajectories); no-op without W&B."""
        self.metrics_logger.log_tables(
            step,
            result,
            split,
            tokenizer=self.tokenizer,
            reward_fillna_value=float(self.cfg.agentlightning.reward_fillna_value),
        )

    def fit(self, steps: int | None = None, *, progress: bool = True) -> list[dict[str, Any]]:
        """Train until step `trainer.total_training_steps` (else `total_epochs` epochs), or for
        `steps` more steps. Resumes first per `trainer.resume_mode`; validates first when
        `trainer.val_before_train` (and only, when `trainer.val_only`)."""
        from agl_lab.progress import progress_bar

        self._check_open("fit()")
        self.resume()
        total = self.global_step + steps if steps is not None else self.total_steps
        self._last_step = total
        history: list[dict[str, Any]] = []
        if (self.cfg.trainer.val_before_train or self.cfg.trainer.val_only) and self.val_dataset:
            val = self.validate(step=self.global_step)
            self.metrics_logger.log(self.global_step, val)
            history.append(val)
            if self.cfg.trainer.val_only:
                return history
        bar = progress_bar(total=total, initial=self.global_step, disable=not progress, desc="train", leave=False)
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
        return self.metrics_logger.frame

    def plot_metrics(self, path: str | os.PathLike | None = None):
        """Training reward per step (and validation reward where validation ran); saves a PNG
        when `path` is given and returns its Path, else returns the Axes; None before the
        first step. `fit` writes `run_dir/reward_curve.png` at each validation and at its end."""
        return self.metrics_logger.write_curve(path)

    @property
    def total_steps(self) -> int:
        """The global step `fit()` trains until when not given `steps`: `trainer.total_training_steps`,
        else `trainer.total_epochs` epochs of `data.train_batch_size` tasks each."""
        if self.cfg.trainer.total_training_steps:
            return int(self.cfg.trainer.total_training_steps)
        per_epoch = max(len(self.train_dataset) // int(self.cfg.data.train_batch_size), 1)
        return per_epoch * int(self.cfg.trainer.total_epochs)

    def validate(self, step: int | None = None) -> dict[str, Any]:
        """One rollout per validation task at the gateway's val temperature; `val/*` metrics and
        `timing_s/validate`. `step` (default: the current step) is the step the W&B tables and the
        recording (`agl_lab.recording.load_validation(run_dir, step)`) are filed under.
        """
        from agl_lab.validation import build_validation

        self._check_open("validate()")
        if not self.val_dataset:
            raise ValueError("no validation tasks: set agl_lab.task.n_val > 0 or pass val_dataset")
        t0 = time.time()
        repeat = int(self.cfg.actor_rollout_ref.rollout.val_kwargs.n)  # verl interleaves the copies
        tasks = [t for t in self.val_dataset for _ in range(max(repeat, 1))]
        ro = self.rollout(tasks, is_train=False)
        val = build_validation(ro.rollouts, float(self.cfg.agentlightning.reward_fillna_value), self.tokenizer)
        step = self.global_step if step is None else step
        self._log_tables(step, val, "validation")
        metrics = {
            **val.metrics,
            **{k: v for k, v in ro.metrics.items() if k.startswith("training/async/proxy")},
            "timing_s/validate": time.time() - t0,
        }
        self.recorder.record_validation(step, ro.rollouts, metrics)
        return metrics

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
            "rng": checkpoints.rng_state(),
        }
        checkpoints.save_state(state, path / checkpoints.STATE_FILE)  # tensors and plain data
        OmegaConf.save(config_mod.redact_secrets(self.cfg), path / "config.yaml")  # interpolations kept
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, overrides: Sequence[str] | None = None, **kwargs) -> Trainer:
        """A Trainer that continues exactly where `save(path)` left off."""
        path = Path(path)
        trainer = cls(config_mod.load_saved_config(path / "config.yaml", overrides or ()), **kwargs)
        trainer.restore(path)
        return trainer

    def restore(self, path: str | os.PathLike) -> None:
        """Load `save(path)` into this Trainer: weights, optimiser, RNG, data cursor, carry-over."""
        path = Path(path)
        self.engine.load(str(path / "engine"))
        state = checkpoints.load_state(path / checkpoints.STATE_FILE)  # weights_only=True
        self.global_step = state["global_step"]
        self.feeder.load_state_dict(state["feeder"])
        if self.async_manager and state["async"]:
            self.async_manager.load_state_dict(state["async"])
        checkpoints.set_rng_state(state["rng"])
        self._resumed = True
        dropped = self.metrics_logger.drop_after(self.global_step) + self.recorder.drop_after(self.global_step)
        if dropped:  # a killed run's later steps: redone now
            logger.warning(
                "metrics.jsonl and recording/: dropped what steps after %d wrote (resumed there)", self.global_step
            )

    @property
    def checkpoint_root(self) -> Path:
        """`trainer.default_local_dir` (verl: checkpoints/{project}/{experiment})."""
        return checkpoints.checkpoint_root(self.cfg)

    def save_checkpoint(self) -> Path:
        """`save()` to `default_local_dir/global_step_N` atomically, then mark it the latest
        (`latest_checkpointed_iteration.txt`, as verl); keeps the newest
        `trainer.max_actor_ckpt_to_keep` this Trainer saved (`checkpoints.prune`)."""
        return checkpoints.save_atomically(
            self.checkpoint_root,
            self.global_step,
            self.save,
            saved=self._saved,
            keep=self.cfg.trainer.get("max_actor_ckpt_to_keep"),
        )

    def resume(self) -> Path | None:
        """Resume once per `trainer.resume_mode`: `auto` (latest checkpoint under
        `default_local_dir`, none → start fresh), `resume_path` (`trainer.resume_from_path`),
        `disable`. Returns the checkpoint loaded, if any."""
        if self._resumed or self.global_step > 0:
            return None
        path = checkpoints.resume_target(self.cfg)
        if path is not None:
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
            raise RuntimeError(
                f"this Trainer is closed (its engine, gateway and runner are stopped), so "
                f"{what} cannot run; create a new Trainer (Trainer.from_config(...)). "
                "Results you already have (rollouts, batches, trainer.metrics) stay readable."
            )

    def __repr__(self) -> str:
        cfg = self.cfg
        engine = getattr(self, "engine", None)
        task = self.task.name if self.task is not None else getattr(self.agent, "__name__", self.agent)
        parts = [
            f"engine={cfg.agl_lab.engine}",
            f"model={getattr(engine, 'model_name', None) if engine is not None else None}",
            f"task={task}",
            f"step={self.global_step}",
            f"policy_version={getattr(engine, 'policy_version', None)}",
            f"run_dir={str(getattr(self, 'run_dir', None))!r}",
        ]
        if getattr(self, "_closed", False):
            parts.append("closed")
        return f"Trainer({', '.join(parts)})"

    def close(self) -> None:
        self._closed = True
        while self._closers:
            closer = self._closers.pop()
            with contextlib.suppress(Exception):
                closer()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass
