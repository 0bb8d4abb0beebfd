"""Continuous-batching generation for an in-process transformers model, with true logprobs.

The OpenAI server (`openai_server.py`) turns HTTP requests into `submit(prompt_ids, params)`
calls; one scheduler thread runs every admitted request in a single left-padded batch:

    idle ──(first request; wait `batch_window_ms` for company)──▶ prefill new requests
    running ──▶ one decode forward for the whole batch ──▶ sample per request
            ──▶ admit arrivals (their own prefill forward — `fast_decode.forward` where it
                applies — then merged into the batch)
            ──▶ finished requests leave the batch (their KV rows are dropped)

Design decisions, each forced by what RL training needs from the engine:

* **True logprobs.** The reported logprob of a sampled token is
  `log_softmax(logits / T)[token]` (T = 1 for greedy) in float32, computed from the very
  logits the sample was drawn from. top-p filtering decides *what* may be sampled but
  never renormalises the reported number, so the trainer's recomputation
  (`log_softmax(model(x) / T)`) matches to ~1e-6 on CPU float32.
* **Batch-independent sampling.** Every request owns a CPU `torch.Generator` (seeded from
  `seed`, else from OS entropy) that supplies its uniforms; the batch then samples all rows
  at once by inverse CDF (`decode_batch.sample_tokens`). The same seed yields the same
  completion whether it ran alone or among 31 others.
* **Left padding, explicit positions, a slab KV cache** — see `decode_batch.py`: one
  decode step is one forward for the whole batch, and merging arrivals into a running
  batch is exact.
* **A prefix cache** (`prefix_cache.py`): a prefill computes only what no earlier request
  (or earlier reply) already computed — the shared system prompt, a GRPO group's task
  prompt, the previous turns of a multi-turn rollout. Emptied when the weights change.
  Requests admitted together find their common prefix computed once (`_share_prefix`).
* **One intra-op thread by default.** A decode step of a small model is a chain of tiny
  kernels; an OpenMP team on a busy 2-core machine spends more time at barriers than in
  them (measured: 2 threads ran 5-10× *slower* under load). `torch.set_num_threads` in the
  scheduler thread is per thread, so training keeps torch's default. `build_engine` sets
  `num_threads` to the engine's `agl_lab.torch_threads` (every core for a model ≥ 50 M
  parameters: SmolLM2's decode batch ran 1.5× faster on 2 threads than on 1).
* **Batch-invariant numbers** (`batch_invariant`, off by default: it makes the engine 2-4×
  slower; `agl_lab.engine_options.batch_invariant`; for the models `fast_decode` supports): a request's logits are bitwise the same alone, among any batch-mates, with any
  padding and with its prompt cached or computed (`fast_decode._invariant_attention`), so a
  seeded run samples the same tokens with the same logprobs on a quiet or a loaded machine.
* **A weights lock.** The model module is shared with the trainer. Each scheduler step
  (forward + sampling) runs under `weights_lock`; the trainer holds the same lock around
  an update, so no forward ever sees half-updated weights.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from agl_lab.engines import openmp
from agl_lab.engines.serving.decode_batch import DecodeBatch, common_token_prefix, sample_tokens
from agl_lab.engines.serving.prefix_cache import BLOCK, CachedPrefix, PrefixCache
from agl_lab.rules import BATCH_WINDOW_MS, MAX_BATCH_SIZE


class GenerationAborted(RuntimeError):
    """Raised into the future of a request that `BatchScheduler.abort()` ended."""


@dataclass
class SamplingParams:
    """Per-request sampling settings (already validated by the HTTP layer)."""

    max_tokens: int
    temperature: float = 1.0  # 0 → greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives to report per position (0 → none)


@dataclass
class GenerationResult:
    """What one request produced. `token_ids` include the EOS / stop token (as vLLM does)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str  # decoded without special tokens; cut before a matched stop string
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None = None


# ---------------------------------------------------------------------------------------
# One request in flight
# ---------------------------------------------------------------------------------------


_STOP_SLACK = 8  # tokens decoded beyond a stop string's length in bytes (`BatchScheduler._find_stop`)


class _Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, future: concurrent.futures.Future):
        self.prompt_ids, self.params, self.future = prompt_ids, params, future
        # Own CPU generator → the draws of a request do not depend on its batch neighbours.
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.generator = torch.Generator().manual_seed(seed % 2**63)  # any int → torch's seed range
        self._uniforms: list[float] = []
        self.out_ids: list[int] = []
        self.out_logprobs: list[float] = []
        self.out_top: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.stop_at: int | None = None  # char index where a stop string begins
        self.cache_generation = -1  # prefix-cache generation its K/V were computed in
        self.cancelled = False  # `BatchScheduler.cancel`: retire at the end of the current step

    def next_uniform(self) -> float:
        """The next U[0, 1) draw of this request (drawn 64 at a time: one call per 64 tokens)."""
        if not self._uniforms:
            self._uniforms = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self._uniforms.pop()


# ---------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------


class BatchScheduler:
    """Runs submitted requests in one continuously batched decode loop on a background thread.

    `model` is any HF causal LM accepting `past_key_values`, `attention_mask`, `position_ids`
    and `logits_to_keep`; `tokenizer` decodes (stop strings, final text).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_window_ms: float = BATCH_WINDOW_MS,
        max_batch_size: int = MAX_BATCH_SIZE,
        weights_lock: threading.RLock | None = None,
        num_threads: int | None = 1,
        prefix_cache_mb: float = 256,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be ≥ 1")
        self.model, self.tokenizer = model, tokenizer
        self.batch_window_s = batch_window_ms / 1000.0
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads
        self.weights_lock = weights_lock or threading.RLock()
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = _eos_ids(model, tokenizer)
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 else None
        self.fast_decode = True  # False: decode through the model's HF forward (benchmarks compare)
        self.fast_prefill = True  # False: prefill through the model's HF forward (benchmarks compare)
        self.share_prefix = True  # False: every admitted row computes its whole uncached prompt (benchmarks compare)
        # True: a row's numbers independent of its batch-mates (`agl_lab.engine_options.batch_invariant`)
        self.batch_invariant = False
        self._cond = threading.Condition()
        self._queue: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # rows of the batch, in order
        self._batch: DecodeBatch | None = None
        self._paused = False
        self._closed = False
        # counters for benchmarks and tests: forwards, tokens, time inside forward / whole steps
        self.stats: dict[str, float] = {
            "steps": 0,
            "prefills": 0,
            "merges": 0,
            "tokens": 0,
            "aborted": 0,
            "max_batch": 0,
            "forward_s": 0.0,
            "step_s": 0.0,
            "prefill_s": 0.0,
            "prefill_tokens": 0,
            "cached_tokens": 0,
            "shared_prefills": 0,  # common prefixes of an admitted batch computed once (`_share_prefix`)
            "decode_rows": 0,  # rows over all decode steps: / steps = the mean decode batch (#51)
            # a decode step's shared prefix block (`decode_batch.SharedPrefix`, read once for all rows), its
            # columns summed over the steps; and the columns copied back into row slabs when batches of
            # different blocks merged (rows × columns: the fallback, counted)
            "shared_columns": 0,
            "spilled_columns": 0,
            "thread_releases": 0,  # the loop's OpenMP pool given back when it ran out of work (`openmp`)
        }
        self._thread = threading.Thread(target=self._loop, name="agl-lab-scheduler", daemon=True)
        self._thread.start()

    # --- public control -------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        """Queue one request; the future resolves to a `GenerationResult` (or GenerationAborted)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        seq = _Sequence(list(prompt_ids), params, future)
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed; start a new server")
            self._queue.append(seq)
            self._cond.notify_all()
        return future

    def pause(self, wait: bool = True, timeout: float | None = None) -> None:
        """Admit no new request; with `wait`, block until the running ones have finished."""
        with self._cond:
            self._paused = True
            if wait and not self._cond.wait_for(lambda: not self._running, timeout=timeout):
                raise TimeoutError(f"{len(self._running)} generations still running after {timeout} s")

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def abort(self) -> int:
        """Fail every queued and running request with GenerationAborted; returns how many."""
        with self.weights_lock:  # between two steps: the batch is consistent
            with self._cond:
                victims = list(self._queue) + self._running
                self._queue.clear()
                self._running, self._batch = [], None
                self._cond.notify_all()
        for seq in victims:
            if not seq.future.done():
                seq.future.set_exception(GenerationAborted("generation aborted"))
        self.stats["aborted"] += len(victims)
        return len(victims)

    def cancel(self, future: concurrent.futures.Future) -> bool:
        """Stop one request: a queued one never starts, a running one retires at the end of the
        current step (finish_reason "abort"). False when it had already finished."""
        if future.cancel():
            return True
        with self._cond:
            for s in self._running:
                if s.future is future and s.finish_reason is None:
                    s.cancelled = True
                    return True
        return False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self.abort()

    def num_pending(self) -> tuple[int, int]:
        """(queued, running) request counts."""
        with self._cond:
            return len(self._queue), len(self._running)

    # --- the loop -----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            if self.num_threads and torch.get_num_threads() != self.num_threads:
                # Per-thread setting (OpenMP ICV): the trainer's threads keep their own. Read at every
                # step, so an engine can size the loop after it started (`build_engine`).
                torch.set_num_threads(self.num_threads)
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._running or (self._queue and not self._paused))
                if self._closed:
                    return
                idle = not self._running
            if idle and self.batch_window_s > 0:
                time.sleep(self.batch_window_s)  # let concurrent requests arrive together
            try:
                with self.weights_lock, torch.inference_mode():
                    t0 = time.perf_counter()
                    self._step()
                    self.stats["step_s"] += time.perf_counter() - t0
            except Exception as exc:  # a model error must not kill the server: fail the batch
                self._fail_all(exc)
            if not self._running and (self._paused or not self._queue):
                # out of work: the next computing thread (the trainer's update) gets the cores' only
                # OpenMP pool, unthrottled (`agl_lab.engines.openmp`)
                self.stats["thread_releases"] += openmp.release_threads()
            # Critical: yield the GIL between steps. Locks are not fair: a thread waiting for
            # `weights_lock` (the trainer's update, a weight sync) would otherwise watch this
            # loop re-take it step after step until every running request has finished.
            time.sleep(0)

    def _step(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.check_weights(self.model)  # an update empties it
        with self._cond:
            room = self.max_batch_size - len(self._running)
            admitted = []
            while room > 0 and self._queue and not self._paused:
                seq = self._queue.popleft()
                if seq.future.set_running_or_notify_cancel():  # skip requests cancelled while queued
                    admitted.append(seq)
                    room -= 1
        if self._running:
            self._decode()  # first: a stream of arrivals must never stall the running rows
        if admitted:
            try:
                self._prefill(admitted)  # their first token, then they join the batch
            except Exception as exc:
                for seq in admitted:
                    if not seq.future.done():
                        seq.future.set_exception(exc)
                raise
        for s in self._running:
            if s.cancelled and s.finish_reason is None:
                s.finish_reason = "abort"
        self._retire_finished()

    def _share_prefix(self, new: list[_Sequence]) -> None:
        """Compute the admitted prompts' common prefix once and cache it before their prefill.

        Cache matches are looked up before a prefill runs, so the requests admitted together —
        a GRPO group's n identical prompts, every task's shared system prompt and tool list —
        would otherwise each compute the same columns. One single-row forward over the common
        prefix (from whatever the cache already holds of it; the last token of the shortest prompt
        stays with its row) puts it in the cache; each row's prefill then starts after it. Worth
        it from two rows and a whole block of new columns on.
        """
        cache = self.prefix_cache
        if cache is None or len(new) < 2 or not self.share_prefix:
            return
        prompts = [s.prompt_ids for s in new]
        first, shortest = prompts[0], min(len(p) for p in prompts)
        common = common_token_prefix(prompts, shortest)
        # a match stays below its prompt's length (the last token runs in the row's own prefill)
        usable = min(common, shortest - 1)
        if usable < BLOCK:
            return
        m, entry = cache.match(first[: usable + 1])
        if usable - m < BLOCK:  # already cached
            return
        t0 = time.perf_counter()
        batch, _ = DecodeBatch.prefill(
            self.model,
            [first[:usable]],
            temps=[1.0],
            top_p=[1.0],
            greedy=[True],
            pad_id=self.pad_id,
            prefixes=[entry],
            prefix_lens=[m],
            invariant=self.batch_invariant,
            fast=self.fast_decode and self.fast_prefill,
        )
        cache.put(CachedPrefix(list(first[:usable]), *batch.row_kv(0)))
        dt = time.perf_counter() - t0
        self.stats["forward_s"] += dt
        self.stats["prefill_s"] += dt
        # Counted as if the first row had computed these columns itself: its prefill below counts them
        # as cached, so prefill_tokens + cached_tokens stays the prompt tokens of the requests.
        self.stats["prefill_tokens"] += usable - m
        self.stats["cached_tokens"] -= usable - m
        self.stats["shared_prefills"] += 1

    def _prefill(self, new: list[_Sequence]) -> None:
        ps = [s.params for s in new]
        cache = self.prefix_cache
        self._share_prefix(new)
        matches = [cache.match(s.prompt_ids) for s in new] if cache is not None else [(0, None)] * len(new)
        lens = [m for m, _ in matches]
        t0 = time.perf_counter()
        batch, logits = DecodeBatch.prefill(
            self.model,
            [s.prompt_ids for s in new],
            temps=[p.temperature or 1.0 for p in ps],
            top_p=[p.top_p for p in ps],
            greedy=[p.temperature == 0 for p in ps],
            pad_id=self.pad_id,
            prefixes=[e for _, e in matches],
            prefix_lens=lens,
            invariant=self.batch_invariant,
            fast=self.fast_decode and self.fast_prefill,
        )
        dt = time.perf_counter() - t0
        self.stats["forward_s"] += dt
        self.stats["prefill_s"] += dt
        self.stats["prefill_tokens"] += sum(len(s.prompt_ids) - m for s, m in zip(new, lens))
        self.stats["cached_tokens"] += sum(lens)
        if cache is not None:
            for i, (s, m) in enumerate(zip(new, lens)):
                s.cache_generation = cache.generation
                if len(s.prompt_ids) - m >= BLOCK:  # new blocks: siblings arriving later can reuse them
                    cache.put(CachedPrefix(list(s.prompt_ids), *batch.row_kv(i)))
        self._sample(logits, new, batch)
        if self._batch is not None:
            self.stats["merges"] += 1
            self.stats["spilled_columns"] += self._batch.align_shared(batch)
            batch = self._batch.merge(batch)
        self._batch = batch
        with self._cond:
            self._running = self._running + new
        self.stats["prefills"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(self._running))

    def _decode(self) -> None:
        t0 = time.perf_counter()
        logits = self._batch.decode(self.model, fast=self.fast_decode, invariant=self.batch_invariant)
        self.stats["forward_s"] += time.perf_counter() - t0
        self._sample(logits, self._running, self._batch)
        self.stats["steps"] += 1
        self.stats["decode_rows"] += len(self._running)
        self.stats["shared_columns"] += len(self._batch.shared) if self._batch.shared else 0

    # --- sampling and stopping ------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence], batch: DecodeBatch) -> None:
        """logits [b, V] of `batch` (rows aligned with `seqs`) → the next pending token of each row."""
        uniforms = torch.tensor([s.next_uniform() for s in seqs], dtype=torch.float64, device=logits.device)
        tokens, logp = sample_tokens(logits, batch.temps, batch.top_p, batch.greedy, uniforms, batch.nucleus)
        batch.tokens = tokens
        chosen, chosen_lp = tokens.tolist(), logp.gather(1, tokens[:, None])[:, 0].tolist()
        k = max(s.params.top_logprobs for s in seqs)
        top_vals = top_ids = None
        if k > 0:
            top = logp.topk(k, dim=-1)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        for i, s in enumerate(seqs):
            s.out_ids.append(chosen[i])
            s.out_logprobs.append(chosen_lp[i])
            if s.params.top_logprobs:
                n = s.params.top_logprobs
                s.out_top.append(list(zip(top_ids[i][:n], top_vals[i][:n])))
            self._check_stop(s)
        self.stats["tokens"] += len(seqs)

    def _check_stop(self, s: _Sequence) -> None:
        token, p = s.out_ids[-1], s.params
        if not p.ignore_eos and token in self.eos_ids:
            s.finish_reason = "stop"
        elif token in p.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", token
        elif p.stop and self._find_stop(s):
            s.finish_reason = "stop"
        elif len(s.out_ids) >= p.max_tokens:
            s.finish_reason = "length"

    def _find_stop(self, s: _Sequence) -> bool:
        """Whether a stop string now appears in the reply; on a hit, where the text is cut.

        Checked after every token, so a new hit ends in the newest token: each step decodes only the
        last tokens that can hold the longest stop string (every token but a special one is ≥ 1 byte;
        `_STOP_SLACK` more for those), not the whole reply — a long reply cost a quadratic number of
        decoded tokens. Only on a hit is the whole reply decoded, to find the earliest stop."""
        stops = [stop for stop in s.params.stop if stop]
        window = max(len(stop.encode("utf-8")) for stop in stops) + _STOP_SLACK
        tail = self.tokenizer.decode(s.out_ids[-window:], skip_special_tokens=True)
        if not any(stop in tail for stop in stops):
            return False
        text = self.tokenizer.decode(s.out_ids, skip_special_tokens=True)
        hits = [(text.find(stop), stop) for stop in stops if stop in text]
        if not hits:
            return False
        s.stop_at, s.stop_reason = min(hits)
        return True

    def _retire_finished(self) -> None:
        keep = [i for i, s in enumerate(self._running) if s.finish_reason is None]
        if len(keep) == len(self._running):
            return
        finished = [s for s in self._running if s.finish_reason is not None]
        cache = self.prefix_cache
        if cache is not None:  # prompt + reply: the next call of a multi-turn rollout starts with them
            for i, s in enumerate(self._running):
                if s.finish_reason is not None and s.cache_generation == cache.generation:
                    # the slab holds the prompt and every sampled token but the last (still pending)
                    cache.put(CachedPrefix(s.prompt_ids + s.out_ids[:-1], *self._batch.row_kv(i)))
        self._batch = self._batch.select(keep) if keep else None
        with self._cond:
            self._running = [self._running[i] for i in keep]
            self._cond.notify_all()  # pause(wait=True) may be waiting for an empty batch
        for s in finished:
            s.future.set_result(self._result(s))

    def _result(self, s: _Sequence) -> GenerationResult:
        text = self.tokenizer.decode(s.out_ids, skip_special_tokens=True)
        if s.stop_at is not None:
            text = text[: s.stop_at]
        return GenerationResult(
            token_ids=list(s.out_ids),
            logprobs=list(s.out_logprobs),
            top_logprobs=list(s.out_top) if s.params.top_logprobs else None,
            text=text,
            finish_reason=s.finish_reason or "length",
            stop_reason=s.stop_reason,
        )

    def _fail_all(self, exc: Exception) -> None:
        with self._cond:
            victims = self._running
            self._running, self._batch = [], None
        for s in victims:
            if not s.future.done():
                s.future.set_exception(exc)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config (int or list) plus the tokenizer's eos."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
