"""Every ```python snippet of README.md and docs/*.md runs as written, in order, one namespace
per page (as a notebook would), on the real tiny model, gateway, runner and Trainer.

Two things are made small, nothing else changes: every config gets the small batch sizes
below (appended to the snippet's own overrides, so they win), and `fit(n)` runs at most
`MAX_FIT_STEPS` steps. The snippets write their files (parquet, JSONL, runs/) in a temporary
folder that links `configs/` to the repository's.

A page with Python snippets must be listed in `PAGES`, with what running it must show: a page
added to docs/ with a snippet and not listed fails `test_every_page_with_python_snippets_is_run`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "agl_lab.task.n_train=16",
    "agl_lab.task.n_val=4",
    "agl_lab.runner.concurrency=8",
]
MAX_FIT_STEPS = 6


def _check_readme(namespace: dict, trainers: list, warned: list[str], tmp_path: Path) -> None:
    assert len(trainers) == 1  # the tour (the replay snippet replays its run)
    assert namespace["r"].equal


def _check_your_agent(namespace: dict, trainers: list, warned: list[str], tmp_path: Path) -> None:
    assert len(trainers) == 2  # your own agent, the registered task
    # "A first agent" learns nothing with the untrained tiny model — and says so, twice
    assert any("tiny model gets no warm start (the agent/dataset comes without demonstrations)" in m for m in warned), (
        warned
    )
    assert any("every rollout got reward 0.000, 3 steps in a row" in m and "no warm start" in m for m in warned), warned
    assert (tmp_path / "train.parquet").exists() and len(namespace["rows"]) == len(namespace["train_rows"])


def _check_research(namespace: dict, trainers: list, warned: list[str], tmp_path: Path) -> None:
    # the study's table in docs/research.md, from the recorded runs
    n4, n8 = (namespace["table"].set_index("setting").loc[name] for name in ("n4", "n8"))
    assert (round(n4["training/reward mean"], 3), round(n8["training/reward mean"], 3)) == (0.733, 0.709)
    assert (round(n8["training/reward diff"], 3), round(n8["training/reward diff se"], 3)) == (-0.024, 0.031)
    assert (round(n8["val/reward diff"], 3), n8["val/reward n"]) == (-0.104, 1)


# page (relative to the repository) → what its snippets must have done
PAGES = {"README.md": _check_readme, "docs/your-agent.md": _check_your_agent, "docs/research.md": _check_research}


def snippets(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


def test_pages_have_the_snippets_they_promise():
    assert len(snippets("README.md")) >= 2
    agent = snippets("docs/your-agent.md")
    assert len(agent) >= 3
    assert any("def my_agent" in s and "train_rows" in s for s in agent)
    assert any("register_task" in s for s in agent)


def test_every_page_with_python_snippets_is_run():
    pages = ["README.md", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").rglob("*.md")))]
    with_snippets = [p for p in pages if snippets(p)]
    assert set(with_snippets) <= set(PAGES), (
        f"{sorted(set(with_snippets) - set(PAGES))} hold ```python snippets that no test runs: add them to PAGES"
    )


# pages the README links to that land with another branch of issue 37 (docs/gpu.md: the GPU
# engineer's page); each must go once it exists (`test_pending_pages_are_still_pending`)
PENDING_PAGES: set[str] = set()


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (code blocks hold no headings)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.M)
    }


def test_every_link_of_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken, n = [], 0
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            n += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if rel not in PENDING_PAGES:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert n >= 50, f"only {n} relative links found"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300, "README.md is a front door: move sections to docs/ and link them"
    assert not re.search(r"20\d\d-\d\d-\d\d", text), "dated figures live in docs/benchmarks.md only"
    linked = set(re.findall(r"\]\((docs/[\w\-]+\.md)", text))
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")} | PENDING_PAGES
    assert pages <= linked, f"docs pages the README does not link to: {sorted(pages - linked)}"


def test_dated_figures_live_in_benchmarks_only():
    # the library's docstrings and comments too: they keep the claim, docs/benchmarks.md the dated figure
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "agl_lab").rglob("*.py"))]
    dated = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in pages
        if p.name != "benchmarks.md"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\b20\d\d-\d\d-\d\d\b", line)
    ]
    assert not dated, f"dates belong in docs/benchmarks.md (link there for them): {dated}"


def test_pending_pages_are_still_pending():
    landed = sorted(p for p in PENDING_PAGES if (ROOT / p).exists())
    assert not landed, f"{landed} exist now: remove them from PENDING_PAGES in tests/test_readme.py"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_python_snippet_runs(page, tmp_path, monkeypatch, caplog):
    from agl_lab import config as config_mod
    from agl_lab.trainer import Trainer

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "notebooks").symlink_to(ROOT / "notebooks")
    monkeypatch.chdir(tmp_path)
    load = config_mod.load_config
    monkeypatch.setattr(
        config_mod, "load_config", lambda path=None, overrides=None: load(path, [*(overrides or []), *SMALL])
    )
    fit = Trainer.fit
    monkeypatch.setattr(
        Trainer, "fit", lambda self, steps=None, **kw: fit(self, min(steps or MAX_FIT_STEPS, MAX_FIT_STEPS), **kw)
    )
    namespace: dict = {"__name__": "snippets"}
    trainers: list = []
    try:
        with caplog.at_level(logging.WARNING, logger="agl_lab.watch"):
            for i, code in enumerate(snippets(page)):
                try:
                    exec(compile(code, f"{page} python snippet {i + 1}", "exec"), namespace)
                finally:
                    trainers += [v for v in namespace.values() if isinstance(v, Trainer) and v not in trainers]
    finally:
        for t in trainers:
            t.close()
    PAGES[page](namespace, trainers, [r.getMessage() for r in caplog.records], tmp_path)
