"""Fakes for what the verl engine needs GPUs for: the actor worker group, vLLM replicas, the
server manager and the checkpoint-engine manager. Everything else is verl's own code.

    log = CallLog()
    trainer = fake_verl_trainer(cfg, tasks, log=log, addresses=["127.0.0.1:8001"])
    engine = VerlEngine.wrap(trainer, "fake-model")
    ... drive the engine ...
    log.compressed()     # ["resume_generation", "abort_all_requests", "sleep_replicas", ...]

| fake                  | stands for                                     | records                        |
|-----------------------|------------------------------------------------|--------------------------------|
| FakeActorGroup        | the FSDP actor worker group (DP dispatch)      | compute_log_prob, update_actor |
| FakeReplica           | one vLLM `RolloutReplica` (coroutine methods)  | resume_generation, abort_all…  |
| FakeServerManager     | `LLMServerManager` (replicas, addresses)       | —                              |
| FakeCheckpointManager | `CheckpointEngineManager` (sleep, weight push) | sleep_replicas, update_weights |
| FakeStackTrainer      | `AglRayPPOTrainer` whose `init_workers()`      | close                          |
|                       | installs the fakes above instead of GPU workers |                               |

Each fake keeps its own `calls` (for per-object assertions) and, when given one, appends
`(who, what, detail)` to a shared, thread-safe `CallLog`, so a test can assert the order of
phases across all of them — and across the gateway and the HTTP replicas, which write to
the same log.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from verl.trainer.ppo.utils import Role
from verl.utils import tensordict_utils as tu

from agl_lab.engines.verl.api import verl_import
from agl_lab.engines.verl.trainer import AglRayPPOTrainer, InMemoryDataset

DP = 2


class CallLog:
    """An ordered, thread-safe list of `(who, what, detail)` entries."""

    def __init__(self) -> None:
        self._entries: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()

    def add(self, who: str, what: str, detail: Any = None) -> None:
        with self._lock:
            self._entries.append((who, what, detail))

    def entries(self) -> list[tuple[str, str, Any]]:
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def mark(self) -> int:
        """Position to slice from later: `log.since(mark)`."""
        with self._lock:
            return len(self._entries)

    def since(self, mark: int) -> list[tuple[str, str, Any]]:
        with self._lock:
            return list(self._entries[mark:])

    @staticmethod
    def compress(entries: Sequence[tuple[str, str, Any]]) -> list[str]:
        """`what[ detail]` strings with consecutive repeats collapsed (2 replicas, N generations → 1)."""
        out: list[str] = []
        for _, what, detail in entries:
            text = what if detail is None else f"{what} {detail}"
            if not out or out[-1] != text:
                out.append(text)
        return out

    def compressed(self) -> list[str]:
        return self.compress(self.entries())


class _Recorder:
    who = "fake"

    def __init__(self, log: CallLog | None):
        self.calls: list[Any] = []
        self.log = log

    def _record(self, call: tuple, what: str, detail: Any = None) -> None:
        self.calls.append(call)
        if self.log is not None:
            self.log.add(self.who, what, detail)


class FakeActorGroup(_Recorder):
    """The actor worker group's data-parallel surface: dispatch info, log-probs, update, ckpt.

    Log-probs are a fixed function of the next token (`-token/1000`), entropy 0.5.
    `update_actor` records the rows, verl's mini-batch settings, the keys and the number of
    loss tokens per row (`loss_mask`, after verl removed the padding).
    """

    who = "actor"

    def __init__(self, dp: int = DP, log: CallLog | None = None):
        super().__init__(log)
        self.dp, self._dispatch_info = dp, {}

    def _query_dispatch_info(self, role):
        return list(range(self.dp))

    def compute_log_prob(self, td):
        assert len(td) % self.dp == 0, "verl splits the batch into equal DP chunks"
        ids = td["input_ids"]  # jagged: one sequence per row, padding removed
        values, offsets = ids.values(), ids.offsets()
        lp = torch.zeros(values.shape, dtype=torch.float32)
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            lp[a : b - 1] = -values[a + 1 : b].float() / 1000  # position t predicts token t+1
        self._record(("compute_log_prob", len(td), tu.get(td, "temperature")), "compute_log_prob", len(td))
        nested = torch.nested.nested_tensor_from_jagged(lp, offsets=offsets)
        entropy = torch.nested.nested_tensor_from_jagged(torch.full_like(lp, 0.5), offsets=offsets)
        return tu.get_tensordict({"log_probs": nested, "entropy": entropy}, non_tensor_dict={"metrics": {"mfu": 0.25}})

    def update_actor(self, td):
        assert len(td) % self.dp == 0
        settings = {k: tu.get(td, k) for k in ("global_batch_size", "epochs")}
        loss_mask = td["loss_mask"]
        loss_tokens = (
            [int(row.sum()) for row in loss_mask.unbind()] if loss_mask.is_nested else loss_mask.sum(-1).tolist()
        )
        self.loss_tokens = loss_tokens
        self._record(("update_actor", len(td), settings, sorted(td.keys())), "update_actor", len(td))
        return tu.get_tensordict({}, non_tensor_dict={"metrics": {"pg_loss": [0.5, 0.7], "mfu": 0.3}})

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        Path(local_path, "weights.txt").write_text(str(global_step))
        self._record(("save_checkpoint", local_path), "save_checkpoint")

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        self._record(("load_checkpoint", local_path, Path(local_path, "weights.txt").read_text()), "load_checkpoint")


class FakeReplica(_Recorder):
    """A replica whose coroutine methods only return once *every* replica has entered them:
    called one after another they time out, so a test proves the calls are concurrent."""

    who = "replica"

    def __init__(self, group: list, aborted: int, log: CallLog | None = None):
        super().__init__(log)
        self.group, self.aborted = group, aborted

    async def _rendezvous(self, name: str) -> None:
        self._record(name, name)
        deadline = time.monotonic() + 2.0
        while sum(name in r.calls[-1:] for r in self.group) < len(self.group):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} was not called on all replicas concurrently")
            await asyncio.sleep(0.001)

    async def abort_all_requests(self, reject_request: bool = False):
        await self._rendezvous("abort_all_requests")
        return {"aborted_count": self.aborted, "request_ids": [f"r{i}" for i in range(self.aborted)]}

    async def resume_generation(self):
        await self._rendezvous("resume_generation")


class FakeServerManager:
    def __init__(self, replicas, addresses: Sequence[str] = ("127.0.0.1:8001", "[::1]:8002")):
        self.replicas, self.addresses = replicas, list(addresses)

    def get_replicas(self):
        return self.replicas

    def get_addresses(self):
        return list(self.addresses)


class FakeCheckpointManager(_Recorder):
    who = "checkpoint"

    def sleep_replicas(self):
        self._record(("sleep_replicas",), "sleep_replicas")

    def update_weights(self, global_steps=None):
        self._record(("update_weights", global_steps), "update_weights", global_steps)
        return {}


class FakeStackTrainer(AglRayPPOTrainer):
    """An `AglRayPPOTrainer` whose `init_workers()` installs the fakes instead of spawning
    FSDP workers and vLLM replicas (the objects the real one creates, same attributes)."""

    fakes: tuple[FakeActorGroup, FakeServerManager, FakeCheckpointManager]
    log: CallLog | None = None

    def init_workers(self) -> None:
        self.actor_rollout_wg, self.llm_server_manager, self.checkpoint_manager = self.fakes

    def close(self) -> None:
        if self.log is not None:
            self.log.add("trainer", "close")
        super().close()


def fake_verl_trainer(
    cfg,
    tasks: Sequence[dict],
    *,
    log: CallLog | None = None,
    addresses: Sequence[str] | None = None,
    aborted: Sequence[int] = (3, 4),
    dp: int = DP,
    spawn: bool = True,
) -> FakeStackTrainer:
    """A real `AglRayPPOTrainer` on `cfg` whose GPU-side objects are the fakes above.

    One replica per `aborted` count; `addresses` are what `server_addresses()` returns
    (real loopback servers in the phase tests, made-up ones elsewhere). `spawn=False`
    leaves `init_workers()` to the caller, as `agl_lab.engines.verl.trainer.build_trainer` does.
    """
    ds = InMemoryDataset(tasks, None, cfg.data, name="train_dataset")
    trainer = FakeStackTrainer(
        config=cfg,
        tokenizer=None,
        role_worker_mapping={Role.ActorRollout: object},
        resource_pool_manager=None,
        train_dataset=ds,
        val_dataset=ds,
        collate_fn=verl_import("collate_fn"),
        train_sampler=verl_import("create_rl_sampler")(cfg.data, ds),
    )
    replicas: list = []
    replicas += [FakeReplica(replicas, aborted=n, log=log) for n in aborted]
    manager = FakeServerManager(replicas, addresses if addresses is not None else ("127.0.0.1:8001", "[::1]:8002"))
    trainer.fakes = (FakeActorGroup(dp, log=log), manager, FakeCheckpointManager(log))
    trainer.log = log
    if spawn:
        trainer.init_workers()
    return trainer
