"""The tensor side of continuous batching: a left-padded decode batch, its KV slab, sampling.

Pure torch, no threads: `scheduler.py` owns requests and time; this module owns rows.

A `DecodeBatch` of B rows holds, per row, a *pending* token — sampled, not yet in the KV
cache — and its position id:

| field       | shape            | meaning                                                |
|-------------|------------------|--------------------------------------------------------|
| `layers`    | per layer [B,H,cap,D] | KV slabs; the first `length` columns are filled   |
| `mask`      | [B, length]      | 1 where a cached column is a real token of the row     |
| `tokens`    | [B]              | pending token of each row                              |
| `positions` | [B]              | its position id = number of real tokens before it      |
| `temps`     | [B]              | sampling temperature (1.0 for greedy rows)             |
| `top_p`     | [B]              | nucleus mass                                           |
| `greedy`    | [B] bool         | temperature 0 → argmax                                 |

Rows are left-padded, so every row's newest column is the last one and a decode step is a
single forward of B tokens. Positions count real tokens only (`cumsum(mask) − 1`), so a row
computes the same numbers whatever its neighbours. Two batches merge by left-padding the
shorter cache with zero, masked columns — exact, because cached keys already carry RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from agl_lab.engines import precision
from agl_lab.engines.serving import fast_decode
from agl_lab.engines.serving.prefix_cache import CachedPrefix

_HEADROOM = 64  # spare cache columns allocated with a slab, so most steps write in place


# ---------------------------------------------------------------------------------------
# KV slab: an HF cache layer writing into a growing buffer
# ---------------------------------------------------------------------------------------


class SlabLayer(CacheLayerMixin):
    """HF cache layer that writes new keys/values into a preallocated buffer, in place.

    HF's `DynamicLayer` `torch.cat`s the whole cache at every step (O(B·L) copies per
    token); this layer copies only the new column and doubles the buffer when it is full.

    The buffer [row capacity, KV, column capacity, D] holds the batch's `rows` rows in its
    first rows and their `length` cached columns in a window starting at `start`; `keys` /
    `values` are views of that window. Arrivals (`append_rows`) and retirements (`keep_rows`)
    edit the buffer in place: an arrival copies only its own rows in (a longer one widens the
    window to the left), a retirement moves up only the rows after the first retired one and
    narrows the window — the old re-pad + `torch.cat` copied every row at every arrival and
    retirement (#51 item 2). The window is exactly the old left-padded slab, so every forward
    sees the same numbers in the same shapes.
    """

    is_sliding = False

    def __init__(self, kbuf: torch.Tensor | None = None, vbuf: torch.Tensor | None = None, length: int = 0):
        super().__init__()
        self.kbuf, self.vbuf, self.length, self.start = kbuf, vbuf, length, 0
        self.rows = 0 if kbuf is None else kbuf.shape[0]
        if kbuf is not None:
            self._publish()

    def _publish(self) -> None:
        self.is_initialized = True
        window = slice(self.start, self.start + self.length)
        self.keys = self.kbuf[: self.rows, :, window]
        self.values = self.vbuf[: self.rows, :, window]

    def _reallocate(self, row_capacity: int, column_capacity: int, end: int) -> None:
        """New zero buffers; the current rows' window copied so that it ends at column `end`."""
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            # zeros, not empty: masked columns must hold finite numbers (0 · NaN = NaN in attention)
            buf = old.new_zeros((row_capacity, old.shape[1], column_capacity, old.shape[3]))
            buf[: self.rows, :, end - self.length : end] = old[: self.rows, :, self.start : self.start + self.length]
            setattr(self, name, buf)
        self.start = end - self.length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, n, _ = key_states.shape
        # the wider of the two: under bfloat16 autocast V leaves its projection in bfloat16 while K,
        # rotated with float32 cos/sin, is float32 — the slab keeps both in float32 for the decode
        dtype = torch.promote_types(key_states.dtype, value_states.dtype)
        self.kbuf = key_states.new_zeros((b, h, n + _HEADROOM, key_states.shape[-1]), dtype=dtype)
        self.vbuf = value_states.new_zeros((b, h, n + _HEADROOM, value_states.shape[-1]), dtype=dtype)
        self.rows = b

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.kbuf is None:
            self.lazy_initialization(key_states, value_states)
        at, n = self.start + self.length, key_states.shape[-2]
        if at + n > self.kbuf.shape[2]:
            self._reallocate(self.kbuf.shape[0], 2 * (self.length + n), self.length)
            at = self.length
        self.kbuf[: self.rows, :, at : at + n] = key_states
        self.vbuf[: self.rows, :, at : at + n] = value_states
        self.length += n
        self._publish()
        return self.keys, self.values

    def append_rows(self, other: SlabLayer) -> None:
        """Add `other`'s rows after these, the shorter window left-padded with zero columns."""
        n, length = self.rows + other.rows, max(self.length, other.length)
        end = self.start + self.length
        if n > self.kbuf.shape[0] or end < length:  # no room: rows double, the window ends at `length`
            rows = max(n, 2 * self.kbuf.shape[0]) if n > self.kbuf.shape[0] else self.kbuf.shape[0]
            self._reallocate(rows, length + _HEADROOM, length)
            end = length
        elif length > self.length:  # the window widens left over columns retired rows or trims left behind
            self.kbuf[: self.rows, :, end - length : self.start] = 0
            self.vbuf[: self.rows, :, end - length : self.start] = 0
        for buf, src in ((self.kbuf, other.keys), (self.vbuf, other.values)):
            buf[self.rows : n, :, end - length : end - other.length] = 0
            buf[self.rows : n, :, end - other.length : end] = src
        self.rows, self.start, self.length = n, end - length, length
        self._publish()

    def prepend(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Columns every row holds — keys/values [KV, n, D] — put before the window's first column, in
        all rows (a shared prefix block given back to the rows: `DecodeBatch.align_shared`)."""
        n = keys.shape[1]
        if self.start < n:  # no room on the left: the window moves right, ending at length + n
            self._reallocate(self.kbuf.shape[0], self.length + n + _HEADROOM, self.length + n)
        self.start, self.length = self.start - n, self.length + n
        self.kbuf[: self.rows, :, self.start : self.start + n] = keys
        self.vbuf[: self.rows, :, self.start : self.start + n] = values
        self._publish()

    def keep_rows(self, keep: list[int], first: int) -> None:
        """Only rows `keep` (ascending), moved up in place; the window's first `first` columns dropped."""
        moved = next((i for i, row in enumerate(keep) if row != i), len(keep))
        if moved < len(keep):
            rows, window = keep[moved:], slice(self.start, self.start + self.length)
            self.kbuf[moved : len(keep), :, window] = self.kbuf[rows, :, window]  # the gather copies first
            self.vbuf[moved : len(keep), :, window] = self.vbuf[rows, :, window]
        self.rows, self.start, self.length = len(keep), self.start + first, self.length - first
        self._publish()

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return -1


def _prefix_slabs(prefixes: list, lens: list[int], lp: int, spare: int, skip: int = 0) -> list[SlabLayer]:
    """Per layer, a [b, KV, lp + spare, D] slab holding row i's cached columns [skip, skip + m_i) in its
    columns [lp − m_i, lp) (the first `skip` are a shared block's)."""
    ref = next(p for p, m in zip(prefixes, lens) if m > 0)
    layers = []
    for layer, (k0, v0) in enumerate(zip(ref.keys, ref.values)):
        kbuf = k0.new_zeros((len(lens), k0.shape[0], lp + spare, k0.shape[-1]))
        vbuf = v0.new_zeros((len(lens), v0.shape[0], lp + spare, v0.shape[-1]))
        for i, (p, m) in enumerate(zip(prefixes, lens)):
            if m:
                kbuf[i, :, lp - m : lp] = p.keys[layer][:, skip : skip + m]
                vbuf[i, :, lp - m : lp] = p.values[layer][:, skip : skip + m]
        layers.append(SlabLayer(kbuf, vbuf, lp))
    return layers


SHARED_MIN = 32  # columns a prefix block needs before every row's queries read it as one (`SharedPrefix`)


@dataclass
class SharedPrefix:
    """The first P columns of every row of a batch, held once: their token ids and, per layer,
    keys/values [KV, P, D] (views of a `CachedPrefix`'s tensors: no copy).

    A decode step reads them once for all rows (`fast_decode._cascade_attention`) instead of once per
    row from the slabs — in a GRPO phase every call begins with the same system prompt and tool
    list. The rows' slabs and `DecodeBatch.mask` hold only the columns after them."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def of(cls, entry: CachedPrefix | SharedPrefix, n: int) -> SharedPrefix:
        """The first `n` columns of a cached sequence (or of a larger block)."""
        return cls(entry.tokens[:n], [k[:, :n] for k in entry.keys], [v[:, :n] for v in entry.values])

    def __len__(self) -> int:
        return len(self.tokens)

    def common(self, other: SharedPrefix | None) -> int:
        """How many leading columns the two blocks share (equal tokens: equal K/V up to rounding)."""
        if other is None:
            return 0
        return common_token_prefix([self.tokens, other.tokens], min(len(self), len(other)))


def common_token_prefix(prompts: list[list[int]], most: int) -> int:
    """How many leading tokens all prompts share, at most `most`."""
    first = prompts[0][:most]
    for p in prompts[1:]:
        if p[: len(first)] != first:
            first = first[: next((i for i, (a, b) in enumerate(zip(first, p)) if a != b), len(p))]
    return len(first)


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists → (input_ids [b, L], attention_mask [b, L]), padded on the left."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, length - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, length - len(s) :] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------
# Sampling: all rows at once, each with its own uniform draw
# ---------------------------------------------------------------------------------------


def sample_tokens(
    logits: torch.Tensor,
    temps: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    nucleus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and the log-probabilities it was drawn from.

    logits [b, V], temps [b] (> 0), top_p [b] in (0, 1], greedy [b] bool, uniforms [b] in
    [0, 1) → (tokens [b], logp [b, V] = log_softmax(logits / T) in float32).

    Inverse-CDF sampling: a row keeps the smallest prefix of its sorted distribution whose
    mass reaches top_p and picks the first token whose cumulative kept mass exceeds
    u · (kept mass). A row whose top_p is 1 draws from the unsorted distribution whatever its
    batch-mates' top_p, so a seeded row's token does not depend on them; `nucleus=False`
    (every top_p is 1) skips the sort.
    """
    logits = logits.float()
    # Critical: the reported logprobs are the un-truncated temperature-scaled distribution;
    # top-p only decides what may be drawn, it never renormalises these numbers.
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    probs = logp.exp()
    tokens = _inverse_cdf(probs, uniforms)
    if nucleus:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        probs = probs.masked_fill(before >= top_p[:, None], 0.0)  # the top token always stays
        kept = order.gather(1, _inverse_cdf(probs, uniforms)[:, None])[:, 0]
        tokens = torch.where(top_p < 1.0, kept, tokens)
    return torch.where(greedy, logits.argmax(-1), tokens), logp


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [b, V] (unnormalised), uniforms [b] → [b]: the first index whose cumulative mass
    exceeds u · (row mass); right=True never picks a zero-mass token."""
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)[:, 0]


# ---------------------------------------------------------------------------------------
# The batch
# ---------------------------------------------------------------------------------------


@dataclass
class DecodeBatch:
    """B left-padded rows with their KV slabs and pending tokens (see the module table)."""

    layers: list[SlabLayer]
    mask: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    temps: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    shared: SharedPrefix | None = None  # columns before every row's slab columns, held once

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def nucleus(self) -> bool:
        return bool((self.top_p < 1.0).any())

    @classmethod
    def prefill(
        cls,
        model: Any,
        prompts: list[list[int]],
        temps: list[float],
        top_p: list[float],
        greedy: list[bool],
        pad_id: int,
        prefixes: list[CachedPrefix | None] | None = None,
        prefix_lens: list[int] | None = None,
        invariant: bool = False,
        fast: bool = True,
    ) -> tuple[DecodeBatch, torch.Tensor]:
        """One forward over the left-padded prompts → (batch with no pending tokens yet, logits [b, V]).

        With `prefixes` (row i's first `prefix_lens[i]` tokens already computed in a
        `CachedPrefix`), only the rest of each prompt runs: the cached K/V are copied into the
        slabs, right-aligned in the first Lp = max(prefix_lens) columns, and the suffixes
        follow, left-padded. Row i may thus hold masked columns *between* its prefix and its
        suffix — harmless, the mask and explicit positions make every row exact.

        `fast` (and `fast_decode.supports(model)`): the forward is `fast_decode.forward` — the decode
        loop's packed (LoRA-merged) weights and one fused attention a layer, not the HF module with
        its unmerged adapters and per-head K/V copies; the same function to float32 rounding.
        `invariant` (on a supported model, whatever `fast`): its batch-invariant forward — each row's
        logits and K/V bitwise what it would get alone, with any prefix split (see the module docstring).

        On that fast path (not `invariant`, on the CPU) the cached columns every row shares — their common
        prompt prefix, from `SHARED_MIN` columns on — stay in one `SharedPrefix` (row 0's entry's views),
        not copied into each row's slab, and every forward reads them once for the batch.
        """
        device = next(model.parameters()).device
        n = len(prompts)
        lens = list(prefix_lens) if prefixes is not None else [0] * n
        fast = (fast or invariant) and fast_decode.supports(model)
        shared = None
        if fast and not invariant and min(lens) >= SHARED_MIN and fast_decode.cascade_ok(device):
            p = common_token_prefix(prompts, min(lens))
            shared = SharedPrefix.of(prefixes[0], p) if p >= SHARED_MIN else None
        skip = len(shared) if shared else 0
        own = [m - skip for m in lens]  # cached columns in each row's own slab
        lp = max(own)
        ids, mask = (t.to(device) for t in _left_pad([p[m:] for p, m in zip(prompts, lens)], pad_id))
        positions = (mask.cumsum(-1) - 1).clamp(min=0) + torch.tensor(lens, device=device)[:, None]
        if lp == 0:
            layers = None
        else:
            layers = _prefix_slabs(prefixes, own, lp, ids.shape[1] + _HEADROOM, skip)
            pre_mask = torch.zeros((n, lp), dtype=mask.dtype, device=device)
            for i, m in enumerate(own):
                pre_mask[i, lp - m :] = 1
            mask = torch.cat([pre_mask, mask], dim=1)
        if fast:
            layers = layers or [SlabLayer() for _ in model.model.layers]
            kv = (shared.keys, shared.values) if shared else None
            logits = fast_decode.forward(model, layers, ids, positions, mask, invariant=invariant, shared=kv)
        else:
            cache = Cache(layers=layers) if layers else Cache(layer_class_to_replicate=SlabLayer)
            with precision.autocast(model):  # agl_lab.model.compute_dtype=bfloat16: as the decode's products
                out = model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            layers, logits = list(cache.layers), out.logits[:, -1, :].to(next(model.parameters()).dtype)
        batch = cls(
            layers=layers,
            mask=mask,
            tokens=torch.zeros(n, dtype=torch.long, device=device),
            positions=torch.tensor([len(p) for p in prompts], device=device),
            temps=torch.tensor(temps, device=device),
            top_p=torch.tensor(top_p, device=device),
            greedy=torch.tensor(greedy, device=device),
            shared=shared,
        )
        return batch, logits

    def row_kv(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values of the real (unmasked) columns of `row`, the shared block's first, per layer
        [KV, n, D] (copies)."""
        cols = self.mask[row].nonzero()[:, 0]
        keys = [layer.keys[row, :, cols] for layer in self.layers]
        values = [layer.values[row, :, cols] for layer in self.layers]
        if self.shared:
            keys = [torch.cat([s, k], dim=1) for s, k in zip(self.shared.keys, keys)]
            values = [torch.cat([s, v], dim=1) for s, v in zip(self.shared.values, values)]
        return keys, values

    def keep_shared(self, n: int) -> int:
        """Keep only the first `n` columns of the shared block (none below `SHARED_MIN`); the rest go
        into every row's slab, before its own columns. Returns the columns copied (rows × columns)."""
        if not self.shared or len(self.shared) <= n:
            return 0
        n = n if n >= SHARED_MIN else 0
        for layer, k, v in zip(self.layers, self.shared.keys, self.shared.values):
            layer.prepend(k[:, n:], v[:, n:])
        moved = len(self.shared) - n
        self.mask = torch.cat([self.mask.new_ones((self.size, moved)), self.mask], dim=1)
        self.shared = SharedPrefix.of(self.shared, n) if n else None
        return moved * self.size

    def align_shared(self, other: DecodeBatch) -> int:
        """Cut both batches' shared blocks to the columns they have in common (`keep_shared`), so that
        they can merge. Returns the columns copied into row slabs (the counted fallback, #51)."""
        n = self.shared.common(other.shared) if self.shared else 0
        return self.keep_shared(n) + other.keep_shared(n)

    def decode(self, model: Any, fast: bool = True, invariant: bool = False) -> torch.Tensor:
        """Forward the pending tokens (they enter the cache) → next-token logits [B, V].

        `fast` uses `fast_decode.decode_step` when it supports the model (same function,
        fewer copies); otherwise, or with fast=False, the model's own HF forward. `invariant`
        (on a supported model, whatever `fast`): its batch-invariant step. A shared block is read by
        the plain fast step only; the others first give its columns back to the rows (`keep_shared`).
        """
        fast = (fast or invariant) and fast_decode.supports(model)
        if self.shared and (invariant or not fast):
            self.keep_shared(0)
        mask = torch.cat([self.mask, self.mask.new_ones((self.size, 1))], dim=1)
        if fast:
            kv = (self.shared.keys, self.shared.values) if self.shared else None
            logits = fast_decode.decode_step(model, self.layers, self.tokens, self.positions, mask, invariant, kv)
        else:
            out = model(
                input_ids=self.tokens[:, None],
                attention_mask=mask,
                position_ids=self.positions[:, None],
                past_key_values=Cache(layers=self.layers),
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1, :]
        self.mask, self.positions = mask, self.positions + 1
        return logits

    def merge(self, other: DecodeBatch) -> DecodeBatch:
        """Rows of `self` then rows of `other`, the shorter cache left-padded with masked zeros.

        In place: `self`'s slabs take `other`'s rows (`SlabLayer.append_rows`); returns `self`. The shared
        blocks are first cut to their common columns (`align_shared`)."""
        self.align_shared(other)
        length = max(self.length, other.length)
        for la, lb in zip(self.layers, other.layers):
            la.append_rows(lb)

        def left(m: torch.Tensor) -> torch.Tensor:
            return torch.cat([m.new_zeros((m.shape[0], length - m.shape[1])), m], dim=1)

        self.mask = torch.cat([left(self.mask), left(other.mask)])
        for f in _ROW_FIELDS:
            setattr(self, f, torch.cat([getattr(self, f), getattr(other, f)]))
        return self

    def select(self, keep: list[int]) -> DecodeBatch:
        """Only rows `keep` (ascending); leading columns that are padding in every kept row are dropped.

        In place (`SlabLayer.keep_rows`); returns `self`."""
        rows = torch.tensor(keep, device=self.mask.device)
        mask = self.mask[rows]
        first = int((mask.sum(0) > 0).nonzero()[0])
        for layer in self.layers:
            layer.keep_rows(keep, first)
        self.mask = mask[:, first:]
        for f in _ROW_FIELDS:
            setattr(self, f, getattr(self, f)[rows])
        return self


_ROW_FIELDS = ("tokens", "positions", "temps", "top_p", "greedy")
