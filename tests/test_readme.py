"""Every ```python snippet of README.md runs as written, in order, in one namespace (as a
notebook would), on the real tiny model, gateway, runner and Trainer.

Two things are made small, nothing else changes: every config gets the small batch sizes
below (appended to the snippet's own overrides, so they win), and `fit(n)` runs at most
`MAX_FIT_STEPS` steps. The snippets write their files (parquet, JSONL, runs/) in a temporary
folder that links `configs/` to the repository's.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "agl_lab.task.n_train=16", "agl_lab.task.n_val=4", "agl_lab.runner.concurrency=8"]
MAX_FIT_STEPS = 6


def readme_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_the_snippets_it_promises():
    snippets = readme_snippets()
    assert len(snippets) >= 4
    assert any("def my_agent" in s and "train_rows" in s for s in snippets)


@pytest.mark.timeout(900)
def test_every_readme_python_snippet_runs(tmp_path, monkeypatch, caplog):
    from agl_lab import config as config_mod
    from agl_lab.trainer import Trainer

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    load = config_mod.load_config
    monkeypatch.setattr(config_mod, "load_config", lambda path=None, overrides=None: load(
        path, [*(overrides or []), *SMALL]))
    fit = Trainer.fit
    monkeypatch.setattr(Trainer, "fit", lambda self, steps=None, **kw: fit(
        self, min(steps or MAX_FIT_STEPS, MAX_FIT_STEPS), **kw))
    namespace: dict = {"__name__": "readme"}
    trainers: list = []
    try:
        with caplog.at_level(logging.WARNING, logger="agl_lab.watch"):
            for i, code in enumerate(readme_snippets()):
                try:
                    exec(compile(code, f"README.md python snippet {i + 1}", "exec"), namespace)
                finally:
                    trainers += [v for v in namespace.values() if isinstance(v, Trainer) and v not in trainers]
    finally:
        for t in trainers:
            t.close()
    assert len(trainers) == 3  # the tour, your own agent, the registered task
    # "Train your own agent" learns nothing with the untrained tiny model — and says so, twice
    warned = [r.getMessage() for r in caplog.records]
    assert any("tiny model gets no warm start (the agent/dataset comes without demonstrations)" in m
               for m in warned), warned
    assert any("every rollout got reward 0.000, 3 steps in a row" in m and "no warm start" in m
               for m in warned), warned
    assert (tmp_path / "train.parquet").exists() and len(namespace["rows"]) == len(namespace["train_rows"])
