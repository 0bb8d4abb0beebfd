"""verl-side classes of the verl engine: in-memory dataset, phase-split RayPPOTrainer, builder.

Imported only when a `VerlEngine` is built, and by tests: importing it imports verl (seconds),
never vLLM (verl loads its vLLM replica class lazily when replicas are created) and needs
no GPU. Every verl symbol comes from `VERL_API` through `verl_import` (see
agl_lab/engines/verl/api.py for the table, agl_lab/engines/verl/engine.py for the phase order and
the replica state machine).

`AglRayPPOTrainer` keeps verl's heavy lifting (FSDP workers, critic, KL, rollout correction,
checkpoints, weight sync) and replaces verl's `fit()` loop by phases:

    serving:   server_addresses · resume_generation · abort_generation · sleep_rollout_replicas · push_weights
    learning:  compute_old_log_probs · prepare_for_advantage · update_policy
    state:     save_to · load_from · close

Advantages and per-rollout normalisation are *not* here: they are pure functions of
`agl_lab.algorithms` that `agl_lab.update` runs between `prepare_for_advantage` and
`update_policy`.
"""

from __future__ import annotations

import copy
import numbers
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from agl_lab.engines.base import sampling_log_probs
from agl_lab.engines.verl.api import call_replicas, verl_import
from agl_lab.rules import mini_batch_rows, uses_bypass

RLHFDataset = verl_import("RLHFDataset")
RayPPOTrainer = verl_import("RayPPOTrainer")

#: agl_lab's own checkpoint state, next to verl's actor/, critic/ and data.pt

# ------------------------------------------------------------------------------------------
# Datasets passed in memory
# ------------------------------------------------------------------------------------------


class InMemoryDataset(RLHFDataset):
    """verl `RLHFDataset` over task rows held in memory: no file round trip, no tokenisation.

    verl's dataloader wants an `RLHFDataset`; agl_lab tasks are plain dicts that go to agents
    untouched, so the file copy (`_download`) and parquet read + prompt filtering
    (`_read_files_and_tokenize`) are skipped. Each item is the row plus

    | key          | value                                                                        |
    |--------------|------------------------------------------------------------------------------|
    | index        | `row["extra_info"]["index"]`, else the row's position (`extra_info: None` ok) |
    | dummy_tensor | `uint8 [1]` — verl's name: a DataProto needs at least one tensor               |
    | (any key of another row) | None — verl's `collate_fn` needs the same keys in every row of a batch |

    Rows are pickled inline (`serialize_dataset=True`) so Ray and dataloader checkpoints carry them.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: Any = None,
        config: Any = None,
        processor: Any = None,
        *,
        name: str = "dataset",
    ):
        rows = list(rows)
        if not rows:
            raise ValueError(f"{name} must be non-empty: pass at least one task row (a dict)")
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise TypeError(f"{name}[{i}] must be a mapping (one task as a dict), got {type(row).__name__}")
        self._rows = [dict(row) for row in rows]
        self._keys = list(dict.fromkeys(key for row in self._rows for key in row))  # union, first-seen order
        config = config if config is not None else {}
        super().__init__(data_files=[], tokenizer=tokenizer, config=config, processor=processor)
        self.serialize_dataset = True

    def _download(self, use_origin_parquet: bool = False) -> None:
        """No files to copy."""

    def _read_files_and_tokenize(self) -> None:
        self.dataframe = self._rows

    def resume_dataset_state(self) -> None:
        self.serialize_dataset = True  # the rows are in the pickle; there is no file to re-read

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, item: int) -> dict[str, Any]:
        row = {key: None for key in self._keys}
        row.update(self._rows[item])
        extra = row.get("extra_info")
        if extra is not None and not isinstance(extra, Mapping):
            raise TypeError(f"row {item}: extra_info must be a mapping or None, got {type(extra).__name__}")
        index = (extra or {}).get("index")
        row["index"] = item if index is None else index
        row["dummy_tensor"] = torch.tensor([0], dtype=torch.uint8)
        return row


# ------------------------------------------------------------------------------------------
# The phase-split trainer
# ------------------------------------------------------------------------------------------


class AglRayPPOTrainer(RayPPOTrainer):
    """verl's RayPPOTrainer driven phase by phase by agl_lab's stepwise Trainer."""

    def __init__(self, *args: Any, **kwargs: Any):
        with warnings.catch_warnings():
            # verl 0.9.1 marks the legacy trainer deprecated in favour of V1 (see verl.py docstring)
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__(*args, **kwargs)
        self.global_steps = 0

    #: the cluster was joined, not started: placement fixes are `ray start` flags (set by VerlEngine)
    placement_fix_is_ray_start = False

    def init_workers(self) -> None:
        """verl's `init_workers`, after the checks of `cluster.py`: its placement groups fit the
        Ray nodes (verl's per-node rule), the paths its workers read exist on every node, and
        the placement groups are made with a bounded wait
        (`agl_lab.verl.placement_timeout_seconds`) before verl asks for them."""
        from agl_lab.engines.verl import cluster

        pools = self.resource_pool_manager
        cluster.check_placement(
            pools.resource_pool_spec,
            pools.max_colocate_count,
            cluster.alive_nodes(),
            joined=self.placement_fix_is_ray_start,
        )
        cluster.check_paths_on_nodes(self.worker_paths())
        timeout = OmegaConf.select(self.config, "agl_lab.verl.placement_timeout_seconds", default=None)
        create = pools.create_resource_pool

        def create_and_place() -> None:
            create()
            cluster.place_pools(
                pools.resource_pool_dict.values(), cluster.PLACEMENT_TIMEOUT_S if timeout is None else float(timeout)
            )

        pools.create_resource_pool = create_and_place  # verl's init_workers calls it first
        super().init_workers()

    def worker_paths(self) -> dict[str, str]:
        """Config key → local path that verl's workers read on their own nodes (model, tokenizer,
        critic model): `cluster.check_paths_on_nodes` checks each node has them."""
        paths = {"actor_rollout_ref.model.path": self.config.actor_rollout_ref.model.path}
        tokenizer = self.config.actor_rollout_ref.model.get("tokenizer_path")
        if tokenizer:
            paths["actor_rollout_ref.model.tokenizer_path"] = tokenizer
        if self.use_critic:
            paths["critic.model.path"] = self.config.critic.model.path
        return {k: str(v) for k, v in paths.items() if v and os.path.exists(str(v))}  # hub names: not paths

    def fit(self) -> None:
        raise NotImplementedError(
            "AglRayPPOTrainer is stepped by agl_lab.Trainer (rollout → build_batch → update); "
            "call agl_lab.Trainer.fit(), not verl's fit()"
        )

    # --- serving ---------------------------------------------------------------------------

    def rollout_replicas(self) -> list[Any]:
        return list(self.llm_server_manager.get_replicas())

    def server_addresses(self) -> list[str]:
        """`host:port` of each replica's OpenAI server (`[v6]:port` for IPv6)."""
        return list(self.llm_server_manager.get_addresses())

    def resume_generation(self) -> None:
        call_replicas(self.rollout_replicas(), "RolloutReplica.resume_generation")

    def abort_generation(self) -> int:
        """Abort in-flight requests on every replica; the number aborted (0 if a backend cannot tell)."""
        results = call_replicas(self.rollout_replicas(), "RolloutReplica.abort_all_requests", reject_request=False)
        return sum(int(r.get("aborted_count", 0)) for r in results if isinstance(r, Mapping))

    def sleep_rollout_replicas(self) -> None:
        self.checkpoint_manager.sleep_replicas()

    def weight_sync_needs_sleep(self) -> bool:
        # backend "naive" (colocated, sync training) loads weights into sleeping replicas only
        return self.config.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"

    def push_weights(self) -> dict[str, Any]:
        """Trained weights → replicas, tagged with `global_steps`; wakes sleeping replicas. A LoRA
        adapter verl loaded into vLLM replicas then serves the calls that name the served model."""
        result = self.checkpoint_manager.update_weights(global_steps=self.global_steps) or {}
        if self.config.actor_rollout_ref.rollout.name == "vllm" and self._lora_as_adapter():
            self.route_calls_to_adapter()
        return result

    def _lora_as_adapter(self) -> bool:
        """verl's own test (`vLLMHttpServer.lora_as_adapter`): a LoRA rank and `lora.merge` off,
        so the replicas hold the adapter apart from the base weights."""
        model = self.config.actor_rollout_ref.model
        lora = model.get("lora") or {}
        return (model.get("lora_rank", 0) > 0 or lora.get("rank", 0) > 0) and not lora.get("merge", False)

    def route_calls_to_adapter(self) -> list[str | None]:
        """On each vLLM replica's OpenAI server, the served model name → verl's LoRA request
        (agl_lab/engines/verl/vllm_lora.py); per replica, the routed name or None (no adapter served)."""
        import ray

        from agl_lab.engines.verl.vllm_lora import route_to_adapter

        # servers[0]: the replica's OpenAI server (the others, on further nodes, run headless)
        servers = [replica.servers[0] for replica in self.rollout_replicas()]
        return ray.get([server.__ray_call__.remote(route_to_adapter) for server in servers])

    # --- learning --------------------------------------------------------------------------

    def data_parallel_size(self) -> int:
        return self._get_dp_size(self.actor_rollout_wg, "actor")

    def compute_old_log_probs(self, batch: Any) -> tuple[Any, float]:
        """`_compute_old_log_prob` on a batch padded to the DP size → (DataProto [N rows], mfu)."""
        return self._run_padded(self._compute_old_log_prob, batch)

    def prepare_for_advantage(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """Old logprobs (recomputed, or `rollout_log_probs` in bypass mode), ref logprobs,
        values, `token_level_rewards` (KL-in-reward) and rollout-correction weights.

        Needs `token_level_scores`, `responses`, `attention_mask`, `input_ids`, `position_ids`
        (agl_lab.batch builds them). Idempotent: a prepared batch is returned unchanged.
        """
        if batch.meta_info.get("agl_lab_prepared"):
            return batch, {}
        if "token_level_scores" not in batch.batch.keys():
            raise ValueError(
                "batch.batch['token_level_scores'] is missing: build the batch with agl_lab.batch.build_batch"
            )
        batch.meta_info.setdefault("temperature", self.config.actor_rollout_ref.rollout.temperature)
        metrics: dict[str, float] = {}
        batch = self._attach_log_probs(batch, metrics)
        if self.use_critic and "values" not in batch.batch.keys():
            batch = self._timed(metrics, "values", lambda: batch.union(self._run_padded(self._compute_values, batch)))
        batch = self._rewards_and_correction(batch, metrics)
        batch.meta_info["agl_lab_prepared"] = True
        return batch, metrics

    def update_policy(self, batch: Any) -> dict[str, float]:
        """Critic then actor update of step `global_steps + 1`; returns reduced worker metrics.

        Old logprobs (and ref logprobs when a reference policy is used) missing from the batch
        are computed here, so `compute_log_probs` + advantage + `update` works like on the
        local engine; critic values must come from `prepare_for_advantage` (GAE needs them).
        A batch that is not a whole number of PPO mini-batches is padded with zero-weight
        rows (`pad_to_mini_batches`; metric `training/n_sample_padded`).
        """
        metrics: dict[str, Any] = {}
        batch = self._attach_log_probs(batch, metrics)
        self._check_update_batch(batch)
        batch, metrics["training/n_sample_padded"] = self.pad_to_mini_batches(batch)
        self.global_steps += 1
        reduce_metrics = verl_import("reduce_metrics")
        metrics["training/global_step"] = self.global_steps
        # rows go to ranks so that verl trains agl_lab's mini-batches at any DP size; with
        # trainer.balance_batch the tokens are balanced across ranks *within* each mini-batch
        # (verl's _balance_batch would move rows into other mini-batches: the update would differ)
        batch = self.rows_in_rank_order(batch, balance=bool(self.config.trainer.balance_batch), metrics=metrics)
        batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
        if self.use_critic:
            out = self._timed(metrics, "update_critic", lambda: self._update_critic(batch))
            metrics.update(reduce_metrics(out.meta_info["metrics"]))
        if self.config.trainer.critic_warmup <= self.global_steps:
            out = self._timed(metrics, "update_actor", lambda: self._update_actor(batch))
            metrics.update(reduce_metrics(out.meta_info["metrics"]))
        return {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real)}

    # --- checkpoints -----------------------------------------------------------------------

    def save_to(self, path: str) -> str:
        """verl `_save_checkpoint` under `path/global_step_N`; returns that folder."""
        from agl_lab.engines.verl.cluster import check_shared_dir

        check_shared_dir(path)  # several nodes: workers write their shards there, on their own disks
        with open_dict(self.config):
            self.config.trainer.default_local_dir = path
        self._save_checkpoint()
        return os.path.join(path, f"global_step_{self.global_steps}")

    def load_from(self, path: str) -> None:
        """verl `_load_checkpoint` from `path/global_step_N` (or the latest under `path`)."""
        folder = (
            path
            if os.path.basename(os.path.normpath(path)).startswith("global_step_")
            else verl_import("find_latest_ckpt_path")(path)
        )
        if folder is None or not os.path.isdir(folder):
            raise FileNotFoundError(
                f"no checkpoint at {path!r}: expected PATH/global_step_N written by engine.save(PATH)"
            )
        from agl_lab.engines.verl.cluster import check_paths_on_nodes

        check_paths_on_nodes({"checkpoint": os.path.abspath(folder)})
        with open_dict(self.config):
            self.config.trainer.resume_mode = "resume_path"
            self.config.trainer.resume_from_path = os.path.abspath(folder)
        self._load_checkpoint()

    def close(self) -> None:
        self._shutdown_dump_executor()

    # --- helpers ---------------------------------------------------------------------------

    def _run_padded(self, fn: Callable[[Any], Any], batch: Any) -> Any:
        """Run an inference phase on `batch` padded (by repeating rows) to a multiple of the DP size.

        Worker groups split a batch into DP chunks and need `len % dp == 0`; the padding rows
        are cut from the output (DataProto, or the first item of a tuple).
        """
        pad_to, unpad = verl_import("pad_dataproto_to_divisor"), verl_import("unpad_dataproto")
        padded, pad_size = pad_to(batch, self.data_parallel_size())
        padded.meta_info["global_token_num"] = torch.sum(padded.batch["attention_mask"], dim=-1).tolist()
        out = fn(padded)
        if isinstance(out, tuple):
            return (unpad(out[0], pad_size), *out[1:])
        return unpad(out, pad_size)

    def _attach_log_probs(self, batch: Any, metrics: dict[str, float]) -> Any:
        """Old logprobs, and ref logprobs when a reference policy is used, unless present."""
        if "old_log_probs" not in batch.batch.keys():
            batch = self._attach_old_log_probs(batch, metrics)
        if self.use_reference_policy and "ref_log_prob" not in batch.batch.keys():
            ref = self._timed(metrics, "ref", lambda: self._run_padded(self._compute_ref_log_prob, batch))
            batch = batch.union(ref)
        return batch

    def _attach_old_log_probs(self, batch: Any, metrics: dict[str, float]) -> Any:
        if uses_bypass(self.config.algorithm.get("rollout_correction", None)):
            # Bypass: sampling logprobs are the old logprobs. Not verl's apply_bypass_mode, which
            # also rewrites policy_loss.loss_mode to "bypass_mode" (dropping per_rollout_mean).
            batch.batch["old_log_probs"] = sampling_log_probs(batch)
            return batch
        start = time.perf_counter()
        output, mfu = self.compute_old_log_probs(batch)
        metrics["timing_s/old_log_prob"] = time.perf_counter() - start
        actor = self.config.actor_rollout_ref.actor
        entropy = verl_import("agg_loss")(
            loss_mat=output.batch["entropys"],
            loss_mask=batch.batch["response_mask"],
            loss_agg_mode=actor.loss_agg_mode,
            loss_scale_factor=actor.loss_scale_factor,
        )
        metrics.update({"actor/entropy": float(entropy.detach().item()), "perf/mfu/actor_infer": float(mfu)})
        output.batch.pop("entropys")
        batch = batch.union(output)
        if "rollout_log_probs" in batch.batch.keys():
            metrics.update(verl_import("calculate_debug_metrics")(batch))
        return batch

    def _rewards_and_correction(self, batch: Any, metrics: dict[str, float]) -> Any:
        if self.config.algorithm.use_kl_in_reward:
            batch, kl_metrics = verl_import("apply_kl_penalty")(
                batch, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=self.config.algorithm.kl_penalty
            )
            metrics.update(kl_metrics)
        else:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        corr = self.config.algorithm.get("rollout_correction", None)
        if corr is not None and not uses_bypass(corr) and "rollout_log_probs" in batch.batch.keys():
            batch, is_metrics = verl_import("compute_rollout_correction_and_add_to_batch")(batch, corr)
            metrics.update(is_metrics)
        return batch

    def _check_update_batch(self, batch: Any) -> None:
        keys = batch.batch.keys()
        missing = [k for k in ("old_log_probs", "advantages", "response_mask") if k not in keys]
        if self.use_critic:
            missing += [k for k in ("values", "returns") if k not in keys]
        if missing:
            raise ValueError(
                f"update(batch) is missing {missing}: run engine.prepare(batch), then the advantage "
                "(agl_lab.algorithms), before engine.update(batch)"
            )
        if len(batch) == 0:
            raise ValueError(
                "update(batch) got 0 rows: skip the step instead (agl_lab.algorithms.prepare_update_batch "
                "returns None when nothing is trainable)"
            )
        mini, dp = self.mini_batch_rows(), self.data_parallel_size()
        if mini % dp:
            raise ValueError(
                f"a PPO mini-batch of actor_rollout_ref.actor.ppo_mini_batch_size × rollout.n = {mini} rows cannot be "
                f"split over {dp} data-parallel ranks: make ppo_mini_batch_size × n a multiple of {dp}"
            )

    def pad_to_mini_batches(self, batch: Any) -> tuple[Any, int]:
        """`batch` grown to a whole number of PPO mini-batches with zero-weight rows → (batch, n_pad).

        verl's worker asserts `rows % mini_batch_rows == 0`, while agl_lab's alignment may
        leave a partial last mini-batch (a batch smaller than one mini-batch with
        `agl_lab.algorithm.small_batch=train`, or whole multi-row rollouts that cannot hit the
        target exactly) — which the local engine trains as a smaller mini-batch. Padding rows
        are copies of the first rows with `response_mask` and `advantages` zeroed: no loss
        token, so the per_rollout_mean loss (a token sum) and the critic loss ignore them.
        Returns the caller's batch unchanged when it is already aligned.
        """
        rows, mini = len(batch), self.mini_batch_rows()
        # Critical: n_pad < mini, so every global mini-batch keeps at least one real row and
        # verl's token-mean terms (entropy, KL loss) never divide by zero loss tokens.
        n_pad = -rows % mini
        if n_pad == 0:
            return batch, 0
        pad = batch.select_idxs(torch.arange(n_pad) % rows)
        for key in ("response_mask", "advantages"):
            pad.batch[key] = torch.zeros_like(pad.batch[key])
        padded = batch.concat([batch, pad])
        padded.meta_info = dict(batch.meta_info)
        return padded, n_pad

    def rows_in_rank_order(self, batch: Any, balance: bool = False, metrics: dict[str, Any] | None = None) -> Any:
        """`batch` reordered so that verl trains exactly agl_lab's mini-batches at any DP size.

        verl cuts a batch into `dp` contiguous chunks, one per rank, and each rank cuts its chunk
        into mini-batches of `M/dp` rows (M = `mini_batch_rows()`): global mini-batch m would be
        the m-th slice of every chunk — rows {0..7, 16..23} of 32 at dp=2, M=16 — not rows
        [m·M, (m+1)·M) that the zero-advantage-first alignment planned (and that dp=1 and the
        local engine train). Rank r's chunk here is, for each m, M/dp rows of mini-batch m:
        rows m·M + r·M/dp … + M/dp, or, with `balance` (`trainer.balance_batch`), the r-th of
        `dp` equal-size groups of mini-batch m's rows with balanced token workloads (verl's
        `calculate_workload` + `get_seqlen_balanced_partitions`, as its `_balance_batch`, but
        per mini-batch); `balance` adds verl's `global_seqlen/*` metrics to `metrics`.
        verl's own `_balance_batch` balances over the whole batch and sorts each rank's rows by
        workload, which moves rows into other mini-batches (at dp=1 too): not used.
        Needs `len(batch) % M == 0` (`pad_to_mini_batches`) and `M % dp == 0` (checked).
        The caller's batch is never reordered in place (a new DataProto, or `batch` itself)."""
        dp, mini = self.data_parallel_size(), self.mini_batch_rows()
        rows = len(batch)
        if rows % mini or (dp == 1 and not balance):
            return batch
        if not balance:
            # [m, r, j] → [r, m, j]: row m·M + r·M/dp + j goes to rank r's chunk, in mini-batch m
            order = torch.arange(rows).view(rows // mini, dp, mini // dp).transpose(0, 1).reshape(-1)
        else:
            seqlens = batch.batch["attention_mask"].view(rows, -1).sum(-1)
            workload = verl_import("calculate_workload")(seqlens).tolist()
            balanced = verl_import("get_seqlen_balanced_partitions")
            ranks: list[list[int]] = [[] for _ in range(dp)]
            for start in range(0, rows, mini):
                groups = balanced(workload[start : start + mini], k_partitions=dp, equal_size=True)
                for rank, group in zip(ranks, groups):
                    rank.extend(start + i for i in sorted(group))
            if metrics is not None:
                metrics.update(
                    verl_import("log_seqlen_unbalance")(
                        seqlen_list=seqlens.tolist(), partitions=ranks, prefix="global_seqlen"
                    )
                )
            order = torch.tensor([i for rank in ranks for i in rank])
        ordered = batch.select_idxs(order)
        ordered.meta_info = dict(batch.meta_info)
        return ordered

    def mini_batch_rows(self) -> int:
        """Rows per PPO mini-batch: verl counts `ppo_mini_batch_size` in tasks, × `rollout.n`."""
        return mini_batch_rows(
            self.config.actor_rollout_ref.actor.ppo_mini_batch_size, self.config.actor_rollout_ref.rollout.n
        )

    @staticmethod
    def _timed(metrics: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        metrics[f"timing_s/{name}"] = time.perf_counter() - start
        return out


# ------------------------------------------------------------------------------------------
# Building the stack (verl's TaskRunner.run, in the driver process, without fit())
# ------------------------------------------------------------------------------------------


def apply_agl_lab_keys(cfg: DictConfig) -> None:
    """Map the engine-independent `agl_lab:` keys onto verl's (same YAML for both engines).

    `agl_lab.model.path` (or the directory of `agl_lab.model.preset`), when set, becomes
    `actor_rollout_ref.model.path`. Everything else, including `critic.model.path` for a GAE
    critic, is read from verl's own keys.
    """
    from agl_lab.models import resolve_model_path

    model_path = resolve_model_path(OmegaConf.select(cfg, "agl_lab.model", default={}) or {})
    if model_path is not None:
        with open_dict(cfg):
            cfg.actor_rollout_ref.model.path = str(model_path)


def build_trainer(
    config: Any, train_dataset: Sequence[Mapping[str, Any]], val_dataset: Sequence[Mapping[str, Any]] | None = None
) -> tuple[AglRayPPOTrainer, str]:
    """Role mapping, resource pools, tokenizer and datasets → an `AglRayPPOTrainer` (workers not
    yet spawned: call `init_workers()`), and the model name vLLM serves (its local path).

    `val_dataset=None` reuses the train rows: verl's trainer insists on a non-empty validation
    dataloader, but agl_lab validates through its own Trainer.
    """
    # a copy: verl resolves and edits its config (total_training_steps, pools); the caller's stays as is
    cfg = copy.deepcopy(config) if isinstance(config, DictConfig) else OmegaConf.create(config)
    apply_agl_lab_keys(cfg)
    verl_import("auto_set_device")(cfg)
    OmegaConf.resolve(cfg)
    runner = verl_import("BaseTaskRunner")()
    _, worker_group_cls = runner.add_actor_rollout_worker(cfg)
    runner.add_critic_worker(cfg)
    runner.add_reward_model_resource_pool(cfg)
    runner.add_teacher_model_resource_pool(cfg)
    verl_import("validate_config")(
        config=cfg,
        use_reference_policy=verl_import("need_reference_policy")(cfg),
        use_critic=verl_import("need_critic")(cfg),
    )
    model_config = verl_import("omega_conf_to_dataclass")(cfg.actor_rollout_ref.model)
    tokenizer, processor = model_config.tokenizer, model_config.processor
    train_ds = InMemoryDataset(train_dataset, tokenizer, cfg.data, processor, name="train_dataset")
    val_ds = InMemoryDataset(
        val_dataset if val_dataset is not None else train_dataset, tokenizer, cfg.data, processor, name="val_dataset"
    )
    trainer = AglRayPPOTrainer(
        config=cfg,
        tokenizer=tokenizer,
        role_worker_mapping=runner.role_worker_mapping,
        resource_pool_manager=runner.init_resource_pool_mgr(cfg),
        ray_worker_group_cls=worker_group_cls,
        processor=processor,
        train_dataset=train_ds,
        val_dataset=val_ds,
        collate_fn=verl_import("collate_fn"),
        train_sampler=verl_import("create_rl_sampler")(cfg.data, train_ds),
    )
    return trainer, str(model_config.local_path)
