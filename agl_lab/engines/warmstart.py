"""Warm start: a short supervised fit that leaves a fresh model *able* but *poor* at a task.

A freshly initialised tiny model emits byte soup, so every rollout would score the same
(zero) and GRPO would see no signal. A warm start fits the model on synthetic transcripts
of the task (`Task.demonstrations`), consumed *in order* as a curriculum: first clean
transcripts, then a final stretch whose content is blurred (for `lookup`, the tool call
names a random key). The model ends up with the format and the skills' machinery (it
calls the tool, copies values, stops at `<|im_end|>`) but has forgotten *which* call to
make, so the RL curve starts low and rises fast — RL sharpens what the warm start taught
loosely. (Why not noisy transcripts from the start: with mostly-noisy data the copy skills
never form in a few hundred steps, and RL cannot discover them from scratch in 100.)

Loss: next-token cross-entropy on the tokens the model would generate (each assistant
reply and its `<|im_end|>`), none on system/user/observation tokens — the loss mask the
batch builder later uses for RL rows.

Determinism and caching: the result is a pure function of the initial weights, the
tokenizer, the task and the fit's hyper-parameters; `warm_start` hashes all of them and
caches the fitted weights as `warmstart-<task>-<hash>.pt` in the tiny model's cache
directory (`$AGL_LAB_CACHE`, default `~/.cache/agl_lab`), so the second call is a load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

WARMSTART_VERSION = 1
DEFAULT_LR = 1e-3  # 3e-3 is unstable for the tiny model: the copy skills then form late or never
DEFAULT_BATCH_SIZE = 32

# ---------------------------------------------------------------------------------------------
# Transcripts → (ids, loss mask)
# ---------------------------------------------------------------------------------------------


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=generation_prompt
        )
    )


def transcript_to_ids(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """`(ids, mask)` of one transcript; mask is 1 on every assistant reply and its EOS.

    Boundaries come from rendering prefixes of the conversation, so they are right for any
    append-only chat template. Raises ValueError when the template is not append-only for
    this transcript (a prefix rendering is not a token prefix of the full rendering).
    """
    ids = _render(tokenizer, messages, False)
    mask = [0] * len(ids)
    eos = tokenizer.eos_token_id
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], True))
        end_ids = _render(tokenizer, messages[: i + 1], False)
        if ids[: len(end_ids)] != end_ids or ids[:start] != _render(tokenizer, messages[:i], True):
            raise ValueError(
                "warm start needs an append-only chat template; this tokenizer's "
                "template re-renders earlier turns (use a ChatML template)"
            )
        # Critical: learn up to and including EOS (the model must learn to stop), not the
        # template's newline after it, which the server never samples.
        reply = end_ids[start:]
        stop = reply.index(eos) + 1 if eos in reply else len(reply)
        for p in range(start, start + stop):
            mask[p] = 1
    return ids, mask


def _pad_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of (ids, mask) into input_ids / attention_mask / labels, each [B, T]."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for b, (ids, mask) in enumerate(rows):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention[b, : len(ids)] = 1
        labels[b, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


# ---------------------------------------------------------------------------------------------
# Cache key
# ---------------------------------------------------------------------------------------------


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _tokenizer_digest(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    blob = json.dumps([vocab, getattr(tokenizer, "chat_template", None), tokenizer.eos_token_id])
    return hashlib.sha256(blob.encode()).hexdigest()


def warm_start_key(model: Any, tokenizer: Any, task_name: str, steps: int, seed: int, **fit: Any) -> str:
    """Hash of every input that determines the warm-started weights (names the cache file)."""
    blob = json.dumps(
        {
            "v": WARMSTART_VERSION,
            "task": task_name,
            "steps": steps,
            "seed": seed,
            "fit": fit,
            "weights": _weights_digest(model),
            "tok": _tokenizer_digest(tokenizer),
            "torch": torch.__version__.split("+")[0],
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from agl_lab.cache import cache_root

    return cache_root()


# ---------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------


def fit_transcripts(
    model: Any,
    tokenizer: Any,
    transcripts: list[list[dict[str, str]]],
    steps: int,
    seed: int,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: str | None = None,
) -> list[float]:
    """`steps` AdamW steps of masked cross-entropy over `transcripts` *in order*; returns the losses.

    Step k fits transcripts[k·B : (k+1)·B] (wrapping around), so the caller's order is a
    curriculum (see `lookup.demonstrations`). One optimiser for the whole fit: a fresh
    AdamW between phases would take full-size first steps and can wreck what was learnt.
    `progress`: a progress-bar description (None: no bar).
    """
    if not transcripts:
        raise ValueError("no transcripts to fit; the task's demonstrations are an empty list")
    rows = [transcript_to_ids(tokenizer, t) for t in transcripts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    bar = None
    if progress is not None:
        from agl_lab.progress import progress_bar

        bar = progress_bar(total=steps, desc=progress, leave=False, mininterval=1.0)
    for step in range(steps):
        batch_rows = [rows[(step * batch_size + j) % len(rows)] for j in range(batch_size)]
        batch = {k: v.to(device) for k, v in _pad_batch(batch_rows, pad_id).items()}
        loss = model(**batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    if bar is not None:
        bar.close()
    model.eval()
    return losses


def _transcripts_digest(transcripts: list[list[dict[str, str]]]) -> str:
    return hashlib.sha256(json.dumps(transcripts, sort_keys=True).encode()).hexdigest()


def _fit_inputs(task: Any, steps: int, seed: int, batch_size: int) -> list[list[dict[str, str]]]:
    """The `steps × batch_size` demonstrations of `task` the fit consumes, in order."""
    if steps < 0:
        raise ValueError(f"steps={steps} must be >= 0 (0 = no warm start)")
    if task.demonstrations is None:
        raise ValueError(
            f"task {task.name!r} has no demonstrations to warm-start on; give "
            "Task(demonstrations=[transcript, ...]) or set agl_lab.model.warm_start_steps=0"
        )
    return task.demonstrations(steps * batch_size, seed)


def _key(
    model: Any, tokenizer: Any, task: Any, transcripts: list, steps: int, seed: int, lr: float, batch_size: int
) -> str:
    # the demonstrations themselves are part of the key: editing a task's transcripts refits
    return warm_start_key(
        model,
        tokenizer,
        task.name,
        steps,
        seed,
        lr=lr,
        batch_size=batch_size,
        demonstrations=_transcripts_digest(transcripts),
    )


def warm_start(
    model: Any,
    tokenizer: Any,
    task: Any,
    steps: int,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    *,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = False,
) -> Any:
    """Fit `model` in place on `steps × batch_size` demonstrations of `task`; returns `model`.

    `task`: an `agl_lab.tasks.Task` (anything with `name` and `demonstrations(n, seed)`;
    `agl_lab.tasks.get_task("lookup")` gives a built-in one). Loads the cached result when one
    exists for the same inputs (`warm_start_key`, the demonstrations included, so editing them
    refits). steps=0 returns the model unchanged. `progress=True` shows a bar naming the task
    and the cache file.
    """
    if steps == 0:
        return model
    transcripts = _fit_inputs(task, steps, seed, batch_size)
    key = _key(model, tokenizer, task, transcripts, steps, seed, lr, batch_size)
    path = _cache_dir(cache_dir) / f"warmstart-{task.name}-{key}.pt"
    if not path.exists():
        with cache_lock(path):  # parallel runs (agl_lab.sweep) compute one warm start, the others load it
            if not path.exists():
                return _fit_and_cache(model, tokenizer, task, transcripts, steps, seed, lr, batch_size, path, progress)
    model.load_state_dict(torch.load(path, map_location=next(model.parameters()).device))
    return model.eval()


def _fit_and_cache(
    model: Any,
    tokenizer: Any,
    task: Any,
    transcripts: list,
    steps: int,
    seed: int,
    lr: float,
    batch_size: int,
    path: Path,
    progress: bool,
) -> Any:
    shown = str(path).replace(str(Path.home()), "~")
    fit_transcripts(
        model,
        tokenizer,
        transcripts,
        steps,
        seed,
        lr,
        batch_size,
        progress=f"warm start on {task.name!r} demonstrations (first run; cached as {shown})" if progress else None,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    torch.save(model.state_dict(), tmp)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared by the user's processes
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old state or the whole file
    return model


@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `<path>.lock` (fcntl.flock, released when the block ends or the
    process dies): one process computes a cache entry while the others wait, then load it."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        handle = open(path.with_name(path.name + ".lock"), "a")
    except OSError:  # a cache directory we cannot write a lock in: compute unlocked (as before)
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another run computes it: say so, or this run waits minutes in silence
            print(f"waiting for another process computing {path.name} (it holds {handle.name})", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def warm_started_model_dir(task: Any, steps: int, seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny model for `seed`, warm-started on `task` (a Task), saved as a Hugging Face directory.

    For engines that load weights from disk (the verl engine's workers and replica): the same
    weights `warm_start` gives the local engine in process. Cached next to the warm-start state.
    """
    from agl_lab.cache import build_cached_dir
    from agl_lab.engines.tiny import load_model_and_tokenizer, tiny_model_dir

    base = tiny_model_dir(seed=seed)
    if steps == 0:
        return base
    model, tokenizer = load_model_and_tokenizer(None, device="cpu", seed=seed)
    transcripts = _fit_inputs(task, steps, seed, DEFAULT_BATCH_SIZE)
    key = _key(model, tokenizer, task, transcripts, steps, seed, DEFAULT_LR, DEFAULT_BATCH_SIZE)

    def build(tmp: Path) -> None:
        warm_start(model, tokenizer, task, steps, seed, cache_dir)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return build_cached_dir(_cache_dir(cache_dir) / f"warmstart-{task.name}-{key}", build)
