"""Prefix cache: keys/values of token sequences the engine has already run, reused by later prefills.

In agentic RL almost every prompt begins with tokens the engine has just computed: the n
rollouts of a GRPO group share the task prompt, every call shares the system prompt and the
tool list, and call k+1 of a rollout extends call k's prompt *and its reply*. A prefill that
finds the longest cached prefix computes only the rest. On SmolLM2-135M with a 30-token
system prompt this removes most of the prefill work under load (see benchmarks/engine.py).

Exactness: the K/V of token t depend only on tokens ≤ t and the weights (causal attention,
RoPE by absolute position), so the first m columns of any cached sequence that agrees with a
prompt on its first m tokens are the prompt's own — up to float32 summation order, the
same ~1e-6 as batching itself. The cache is emptied whenever the weights change (any
parameter's in-place version counter moves: an optimizer step, `load_state_dict`).

Lookup is vLLM's idea at small scale: sequences are cut into blocks of `BLOCK` tokens and
every block is indexed by the hash of the chain of blocks up to it, so matching a prompt is
one dict lookup per block; the match is then verified token by token (no hash trust) and
extended token by token past the last whole block, as far as the entry agrees (an entry holds
the K/V of all its tokens: a call that extends the last one's reply mid-block recomputes only
its own new tokens).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 16  # tokens per indexed block: a match is found to a block boundary


@dataclass
class CachedPrefix:
    """One cached sequence: its token ids and, per decoder layer, keys/values [KV, n, D]."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _block_hashes(tokens: list[int]) -> list[int]:
    """Chain hash of every full block: h_k = hash(h_{k-1}, block k)."""
    out, h = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[start : start + BLOCK])))
        out.append(h)
    return out


class PrefixCache:
    """LRU of `CachedPrefix` entries within `max_bytes`, matched by block-hash chain."""

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # id → entry, least recent first
        self._index: dict[int, int] = {}  # block-chain hash → entry id
        self._next_id = 0
        self._bytes = 0
        self._weights_key: Any = None
        self._params: tuple[weakref.ref, list] | None = None  # (model, its parameters) — `check_weights`
        self.generation = 0  # moves on at every clear: K/V computed under older weights must not be put
        self.stats = {"hits": 0, "lookups": 0, "reused_tokens": 0, "evictions": 0, "invalidations": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self.generation += 1
        self._entries.clear()
        self._index.clear()
        self._bytes = 0

    def check_weights(self, model: Any) -> None:
        """Empty the cache if any parameter of `model` was modified in place since the last call.

        Called before every scheduler step: the parameter list is collected once per model (walking
        a LoRA model's ~1,000 modules took ~5 % of the engine thread), then each step reads only the
        versions and storages. A parameter *replaced* by a new object is not seen: the engines
        update weights in place (optimizer steps, `load_state_dict`); anything else calls `clear()`.
        """
        if self._params is None or self._params[0]() is not model:
            self._params = (weakref.ref(model), list(model.parameters()))
        key = tuple((p._version, p.data_ptr()) for p in self._params[1])
        if key != self._weights_key:
            if self._entries:
                self.stats["invalidations"] += 1
            self.clear()
            self._weights_key = key

    def match(self, tokens: list[int]) -> tuple[int, CachedPrefix | None]:
        """(m, entry): entry's first m tokens equal `tokens[:m]`, m < len(tokens) — at least one whole
        block found by its hash chain, then as many more tokens as the entry and `tokens` share.

        m stays below len(tokens) so a prefill always has at least one token to run (it needs
        the logits of the last prompt position).
        """
        self.stats["lookups"] += 1
        best, entry_id = 0, None
        for k, h in enumerate(_block_hashes(tokens[: len(tokens) - 1])):
            eid = self._index.get(h)
            if eid is None or eid not in self._entries:
                break
            best, entry_id = (k + 1) * BLOCK, eid
        if entry_id is None:
            return 0, None
        entry = self._entries[entry_id]
        if entry.tokens[:best] != tokens[:best]:  # a hash collision: never trust a hash alone
            return 0, None
        limit = min(len(entry.tokens), entry.keys[0].shape[1], len(tokens) - 1)
        while best < limit and entry.tokens[best] == tokens[best]:  # past the last whole block
            best += 1
        self._entries.move_to_end(entry_id)
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += best
        return best, entry

    def put(self, entry: CachedPrefix) -> None:
        """Add `entry` (its blocks now point to it) and evict least recently used entries over budget."""
        if len(entry.tokens) < BLOCK or entry.nbytes > self.max_bytes:
            return
        eid, self._next_id = self._next_id, self._next_id + 1
        self._entries[eid] = entry
        self._bytes += entry.nbytes
        for h in _block_hashes(entry.tokens):
            self._index[h] = eid
        while self._bytes > self.max_bytes:
            old_id, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self.stats["evictions"] += 1
            for h in _block_hashes(old.tokens):
                if self._index.get(h) == old_id:
                    del self._index[h]
