"""A rollout browser for notebooks: pick a group → a rollout → a row, and read its tokens.

The browser reads a built batch only (`trainer.build_batch()`'s `BatchResult`, or
`BatchResult(agl_lab.batch.build_batch(...))`): its `.rows` frame gives the tree
(group → rollout → row) and its `.data` DataProto gives the tokens exactly as they are trained, so what you see is
what the update sees. A rollout's merge breaks (`.breaks`) are shown under its rows.

Two faces, one object:

* **live** (ipywidgets installed, a kernel running): three dropdowns and an HTML pane;
* **static**: a ``<details>`` tree (group → rollout → rows) that any notebook viewer
  renders with no kernel. It is always part of the display bundle (``text/html`` beside the
  widget view), so a notebook saved without widget state (`scripts/build_notebooks.py`
  strips it) still shows the tokens, and an environment without ipywidgets shows it alone.
"""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from agl_lab.viz import legend_html, render_batch_row, render_token_diff_html


def _short(value: Any, n: int = 8) -> str:
    return str(value)[:n]


class RolloutBrowser:
    """Browse the rows of a batch by group and rollout.

    browser = RolloutBrowser(trainer.build_batch(), trainer.tokenizer)
    browser                     # widget when live, static HTML otherwise
    browser.row_html(rid, 0)    # HTML of the first row of rollout `rid`
    """

    def __init__(self, batch: Any, tokenizer: Any = None, *, widgets: bool | None = None, static_rows: int = 4):
        rows = getattr(batch, "rows", None)
        if not isinstance(rows, pd.DataFrame) or getattr(batch, "data", None) is None:
            raise TypeError(
                "RolloutBrowser needs a built batch with .rows and .data: pass the result of "
                "trainer.build_batch() (or agl_lab.results.BatchResult(agl_lab.batch.build_batch(...)))"
            )
        self.batch, self.data, self.tokenizer = batch, batch.data, tokenizer
        self.rows = rows.reset_index(drop=True)
        breaks = getattr(batch, "breaks", None)
        self.breaks = breaks if isinstance(breaks, pd.DataFrame) else pd.DataFrame()
        self.static_rows = int(static_rows)
        self._use_widgets = widgets
        self._widget = None

    # ------------------------------------------------------------------ the tree

    @property
    def groups(self) -> list[str]:
        """Group ids (`data_id`) in batch order."""
        return list(dict.fromkeys(self.rows["data_id"]))

    def rollouts(self, group: str) -> list[str]:
        """Rollout ids of `group` in batch order."""
        return list(dict.fromkeys(self.rows.loc[self.rows["data_id"] == group, "rollout_id"]))

    def rollout_rows(self, rollout_id: str) -> pd.DataFrame:
        """The rows of one rollout (skipped rows included, `batch_index` -1)."""
        return self.rows[self.rows["rollout_id"] == rollout_id]

    def _group_label(self, group: str) -> str:
        rewards = [self.rollout_rows(r)["reward"].iloc[0] for r in self.rollouts(group)]
        return f"group {_short(group)} · rewards " + " ".join(f"{x:.2f}" for x in rewards)

    def _rollout_label(self, rollout_id: str) -> str:
        rows = self.rollout_rows(rollout_id)
        return f"rollout {_short(rollout_id)} · reward {rows['reward'].iloc[0]:.2f} · {len(rows)} row(s)"

    @staticmethod
    def _row_label(k: int, row: pd.Series) -> str:
        where = "skipped" if row.batch_index < 0 else f"batch row {row.batch_index}"
        calls = f"call {row.first_call}" if row.n_calls == 1 else f"calls {row.first_call}–{row.last_call}"
        return f"row {k} · {where} · {calls} · {row.loss_tokens} loss tokens"

    # ------------------------------------------------------------------ HTML

    def row_html(self, rollout_id: str, k: int = 0) -> str:
        """Tokens of the `k`-th row of a rollout (its training row in the batch)."""
        rows = self.rollout_rows(rollout_id)
        if not 0 <= k < len(rows):
            raise IndexError(f"rollout {rollout_id!r} has {len(rows)} row(s); k={k} is out of range")
        row = rows.iloc[k]
        if row.batch_index < 0:
            return (
                f"<div><i>{html.escape(self._row_label(k, row))}: this row has no trainable token "
                "and is not in the batch</i></div>"
            )
        return render_batch_row(
            self.data, int(row.batch_index), self.tokenizer, title=self._row_label(k, row), legend=False
        )

    def breaks_html(self, rollout_id: str) -> str:
        """The token diff of each merge break of a rollout ('' when it has none)."""
        if self.breaks.empty:
            return ""
        breaks = self.breaks[self.breaks["rollout_id"] == rollout_id]
        return "".join(
            render_token_diff_html(b) for _, b in breaks.iterrows() if b["first_divergent_token"] is not None
        )

    def static_html(self, max_rows: int | None = None) -> str:
        """The whole tree as nested ``<details>``; tokens for the first `max_rows` rows only."""
        budget = self.static_rows if max_rows is None else max_rows
        parts = [legend_html()]
        for g, group in enumerate(self.groups):
            items = []
            for r, rid in enumerate(self.rollouts(group)):
                body = []
                for k, (_, row) in enumerate(self.rollout_rows(rid).iterrows()):
                    if budget > 0:
                        body.append(self.row_html(rid, k))
                        budget -= 1
                    else:
                        body.append(
                            f"<div>{html.escape(self._row_label(k, row))} "
                            "<i>(tokens omitted here; browse them with a live kernel)</i></div>"
                        )
                body.append(self.breaks_html(rid))
                opened = " open" if g == 0 and r == 0 else ""
                items.append(
                    f'<details{opened}><summary style="font-size:12px">{html.escape(self._rollout_label(rid))}</summary>'
                    f'<div style="margin-left:16px">{"".join(body)}</div></details>'
                )
            opened = " open" if g == 0 else ""
            parts.append(
                f'<details{opened}><summary style="font-size:13px"><b>{html.escape(self._group_label(group))}</b></summary>'
                f'<div style="margin-left:16px">{"".join(items)}</div></details>'
            )
        return f'<div class="agl-browser">{"".join(parts)}</div>'

    # ------------------------------------------------------------------ widget

    @property
    def widget(self) -> Any:
        """The ipywidgets view (built on first use), or None when ipywidgets is unavailable."""
        if self._use_widgets is False:
            return None
        if self._widget is None:
            try:
                import ipywidgets as w
            except ImportError:
                if self._use_widgets:
                    raise ImportError("RolloutBrowser(widgets=True) needs ipywidgets: pip install ipywidgets") from None
                return None
            self._widget = self._build_widget(w)
        return self._widget

    def _build_widget(self, w: Any) -> Any:
        group = w.Dropdown(options=[(self._group_label(g), g) for g in self.groups], description="group")
        rollout = w.Dropdown(description="rollout")
        row = w.Dropdown(description="row")
        pane = w.HTML()
        for d in (group, rollout, row):
            d.layout = w.Layout(width="560px")

        def choose(dropdown: Any, options: list[tuple[str, Any]]) -> None:
            # Values are unique across parents (rollout ids, (rollout id, k) pairs), so a new
            # parent always changes the value and the observer below refreshes the children.
            dropdown.options = options
            if dropdown.value is None and options:
                dropdown.value = options[0][1]

        def on_group(_=None):
            choose(rollout, [(self._rollout_label(r), r) for r in self.rollouts(group.value)])

        def on_rollout(_=None):
            rows = self.rollout_rows(rollout.value)
            choose(row, [(self._row_label(k, x), (rollout.value, k)) for k, (_, x) in enumerate(rows.iterrows())])

        def on_row(_=None):
            if row.value is not None:
                rid, k = row.value
                pane.value = self.row_html(rid, k) + self.breaks_html(rid)

        group.observe(on_group, names="value")
        rollout.observe(on_rollout, names="value")
        row.observe(on_row, names="value")
        on_group()  # chains down: rollout → row → pane
        return w.VBox([group, rollout, row, pane])

    # ------------------------------------------------------------------ display

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, Any]:
        bundle = {"text/plain": repr(self), "text/html": self.static_html()}
        widget = self.widget
        if widget is not None:
            bundle.update({k: v for k, v in widget._repr_mimebundle_().items() if k != "text/plain"})
        return bundle

    def __repr__(self) -> str:
        return (
            f"RolloutBrowser({len(self.groups)} groups, {self.rows['rollout_id'].nunique()} rollouts, "
            f"{len(self.rows)} rows)"
        )


def browse(batch: Any, tokenizer: Any = None, **kwargs: Any) -> RolloutBrowser:
    """Shorthand for `RolloutBrowser(batch, tokenizer, **kwargs)`."""
    return RolloutBrowser(batch, tokenizer, **kwargs)
