"""viz and widgets: the HTML token renderer, the merge-break diff, the plots and the browser.

Rows are built with the real tiny tokenizer and its ChatML template, then rendered; the
HTML is parsed back (stdlib `html.parser`) so the tests read what a browser would: one
span per token, its classes, and its text.
"""

from __future__ import annotations

import html as html_lib
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from agl_lab import viz
from agl_lab.batch import build_batch
from agl_lab.diagnose import diagnose_break, token_diff
from agl_lab.engines.tiny import load_tokenizer
from agl_lab.records import CompletedRollout, Triplet
from agl_lab.results import BatchResult
from agl_lab.widgets import RolloutBrowser

SYSTEM = {"role": "system", "content": "Reply get KEY or answer VALUE."}


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def chat(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


class Spans(HTMLParser):
    """Collects (classes, text) of every span with class `agl-tok`."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.spans, self._open = [], None

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "span" and "agl-tok" in classes:
            self._open = [set(classes), ""]

    def handle_data(self, data):
        if self._open is not None:
            self._open[1] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.spans.append(tuple(self._open))
            self._open = None


def spans_of(html_text):
    parser = Spans()
    parser.feed(html_text)
    return parser.spans


@pytest.fixture(scope="module")
def conversation(tok):
    """One merged two-call row: prompt, `get c`, an observation full of markup, `answer 7`."""
    p1 = chat(tok, [SYSTEM, {"role": "user", "content": "Find c."}])
    r1 = enc(tok, "get c<|im_end|>")
    obs = enc(tok, "\n<|im_start|>user\nc < 7 & <b>d</b><|im_end|>\n<|im_start|>assistant\n")
    r2 = enc(tok, "answer 7<|im_end|>")
    return p1, r1, obs, r2


def rollout(rid, group, triplets, reward):
    return CompletedRollout(rid, group, step=0, sample_idx=0, triplets=triplets, final_reward=reward)


@pytest.fixture(scope="module")
def batch(tok, conversation):
    """r1 merges into one row; r2 edits its history (drops the system message) → a merge break."""
    p1, r1, obs, r2 = conversation
    lp = lambda ids: [-0.5] * len(ids)  # noqa: E731
    merged = rollout("r1", "g1", [Triplet(p1, r1, lp(r1)), Triplet(p1 + r1 + obs, r2, lp(r2), reward=1.0)], 1.0)
    edited_prompt = chat(
        tok,
        [
            {"role": "user", "content": "Find c."},
            {"role": "assistant", "content": "get c"},
            {"role": "user", "content": "c is 7"},
        ],
    )
    edited = rollout("r2", "g1", [Triplet(p1, r1, lp(r1)), Triplet(edited_prompt, r2, lp(r2), reward=0.3)], 0.3)
    other = rollout("r3", "g2", [Triplet(p1, r1, lp(r1), reward=0.0)], 0.0)
    return BatchResult(
        build_batch(
            [merged, edited, other],
            "trajectory",
            max_prompt_length=64,
            max_response_length=48,
            pad_token_id=tok.pad_token_id,
            tokenizer=tok,
        )
    )


# =========================================================================== token renderer


def test_token_cells_classify_prompt_model_observation_and_special(tok, conversation):
    p1, r1, obs, r2 = conversation
    ids = p1 + r1 + obs + r2
    mask = [1] * len(r1) + [0] * len(obs) + [1] * len(r2)
    cells = viz.token_cells(ids, tok, prompt_len=len(p1), response_mask=mask)
    kinds = [c.kind for c in cells]
    assert kinds == ["prompt"] * len(p1) + ["model"] * len(r1) + ["observation"] * len(obs) + ["model"] * len(r2)
    assert [c.loss for c in cells] == [False] * len(p1) + [bool(m) for m in mask]
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert {c.token_id for c in cells if c.special} == {im_start, im_end}
    assert "".join(c.piece for c in cells) == tok.decode(ids, skip_special_tokens=False)


def test_row_html_marks_exactly_the_model_tokens_and_round_trips_the_text(tok, conversation):
    p1, r1, obs, r2 = conversation
    ids = p1 + r1 + obs + r2
    mask = [1] * len(r1) + [0] * len(obs) + [1] * len(r2)
    out = viz.render_row_html(ids, tok, prompt_len=len(p1), response_mask=mask, title="a <title> & more")
    spans = spans_of(out)
    assert len(spans) == len(ids)
    for (classes, _), kind, loss in zip(spans, ["prompt"] * len(p1) + ["x"] * len(mask), [0] * len(p1) + mask):
        assert ("agl-loss" in classes) == bool(loss)
        assert ("agl-model" in classes) == bool(loss)
        if kind == "prompt":
            assert "agl-prompt" in classes
    assert sum("agl-observation" in c for c, _ in spans) == len(obs)
    # Every token's text, un-escaped, is the decoded row (newlines are shown as ↵ + newline).
    text = "".join(t for _, t in spans).replace("↵\n", "\n")
    assert text == tok.decode(ids, skip_special_tokens=False)
    assert "a &lt;title&gt; &amp; more" in out


def test_row_html_escapes_markup_ampersands_and_special_tokens(tok, conversation):
    p1, r1, obs, r2 = conversation
    out = viz.render_row_html(p1 + r1 + obs, tok, prompt_len=len(p1), response_mask=[1] * len(r1) + [0] * len(obs))
    body = out.split('class="agl-tokens"', 1)[1]
    assert "<|im_start|>" not in out and "<|im_end|>" not in out
    assert "&lt;|im_start|&gt;" in body and "&lt;|im_end|&gt;" in body
    assert "<b>" not in body and "</b>" not in body  # the observation's markup is text, not HTML
    assert "&amp;" in body and "&lt;" in body
    special = [t for c, t in spans_of(out) if "agl-special" in c]
    assert special and set(special) <= {"<|im_start|>", "<|im_end|>"}
    # A special token sampled by the model keeps both marks: model + special.
    assert any({"agl-model", "agl-special", "agl-loss"} <= c for c, _ in spans_of(out))


def test_batch_row_folds_padding_and_matches_the_trained_mask(tok, batch):
    data = batch.data
    for i in range(len(data)):
        out = viz.render_batch_row(data, i, tok)
        spans = spans_of(out)
        pad = [t for c, t in spans if "agl-pad" in c]
        n_pad = int((data.batch["attention_mask"][i] == 0).sum())
        # left padding of the prompt, right padding of the response: at most two folded runs
        assert sum(int(t.split("×")[1].rstrip("⟩")) for t in pad) == n_pad and len(pad) <= 2
        assert sum("agl-loss" in c for c, _ in spans) == int(data.batch["response_mask"][i].sum())
    assert "row 0 · rollout r1" in viz.render_batch_row(data, 0, tok)
    with pytest.raises(IndexError, match="outside the batch"):
        viz.render_batch_row(data, len(data), tok)


def test_bad_masks_name_the_argument(tok):
    with pytest.raises(ValueError, match="response_mask has 2 entries"):
        viz.render_row_html([1, 2, 3, 4], tok, prompt_len=1, response_mask=[1, 1])
    with pytest.raises(ValueError, match="prompt_len=9"):
        viz.render_row_html([1, 2], tok, prompt_len=9, response_mask=[])
    with pytest.raises(ValueError, match="attention_mask has 1 entries"):
        viz.render_row_html([1, 2], tok, prompt_len=1, response_mask=[1], attention_mask=[1])


# =========================================================================== merge-break diff


def test_diff_highlights_the_first_divergent_token_on_both_sides(tok):
    # Retokenization: the model sampled "Hel"+"lo"-like pieces; the prompt re-encodes the text.
    text = " hello world"
    canonical = enc(tok, text)
    sampled = [i for ch in text for i in enc(tok, ch)]  # one id per character: same text, other ids
    assert sampled != canonical
    head = chat(tok, [SYSTEM, {"role": "user", "content": "Say <hi> & go"}])
    a = head + sampled
    b = head + canonical + enc(tok, "<|im_end|>")
    mb = diagnose_break(a, b, tok, model_mask=[0] * len(head) + [1] * len(sampled))
    assert mb.kind == "retokenization"
    out = viz.render_token_diff_html(mb, title="retokenized <reply>")
    spans = spans_of(out)
    diverge = [t for c, t in spans if "agl-diverge" in c]
    assert len(diverge) == 2  # one on A, one on B
    assert diverge == [tok.decode([a[mb.first_divergent_token]]), tok.decode([b[mb.first_divergent_token]])]
    n_same = sum("agl-same" in c for c, _ in spans)
    assert n_same == 2 * (mb.first_divergent_token - mb.window_start)
    assert 'class="agl-kind agl-kind-retokenization"' in out
    assert "retokenized &lt;reply&gt;" in out and "<reply>" not in out
    assert f"first divergent token #{mb.first_divergent_token}" in html_lib.unescape(out)
    # A TokenDiff renders the same spans (without the class badge).
    td = viz.render_token_diff_html(token_diff(a, b, tok))
    assert [t for c, t in spans_of(td) if "agl-diverge" in c] == diverge


def test_diff_from_a_breaks_frame_row(tok, batch):
    breaks = batch.breaks
    assert len(breaks) == 1 and breaks.rollout_id.iloc[0] == "r2"
    out = viz.render_token_diff_html(breaks.iloc[0])
    assert f"agl-kind-{breaks.kind.iloc[0]}" in out
    assert "rollout r2 · call 1" in out
    assert sum("agl-diverge" in c for c, _ in spans_of(out)) == 2
    with pytest.raises(ValueError, match="first_divergent_token is missing"):
        viz.render_token_diff_html({"kind": "template"})


# =========================================================================== plots


def test_moving_average_golden():
    np.testing.assert_allclose(viz.moving_average([1, 2, 3, 4], 2), [1.0, 1.5, 2.5, 3.5])
    assert viz.moving_average([], 3).shape == (0,)


def test_lifecycle_bars_stack_queue_wait_and_run(tmp_path):
    frame = pd.DataFrame(
        {
            "rollout_id": ["a", "b"],
            "data_id": ["g", "g"],
            "queue_wait_s": [0.5, np.nan],
            "run_s": [1.0, 2.0],
            "total_s": [1.5, np.nan],
        }
    )
    ax = viz.plot_lifecycle(frame)
    widths = [p.get_width() for p in ax.patches]
    lefts = [p.get_x() for p in ax.patches]
    assert widths == [0.5, 0.0, 1.0, 2.0] and lefts == [0, 0, 0.5, 0.0]
    assert viz.plot_lifecycle(frame, kind="hist", path=tmp_path / "h.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="lacks columns"):
        viz.plot_lifecycle(frame.drop(columns=["run_s"]))


def test_advantage_histogram_separates_zero_advantage_rollouts(tmp_path):
    # n=4 groups: values sit on what would be bin edges of a 21-bin histogram (±0.5, 1.5)
    a = [0.0] * 3 + [-0.4999983] * 3 + [-0.5000001] * 3 + [1.4999949] * 2
    ax = viz.plot_advantages(pd.DataFrame({"advantage": a}))
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["A ≠ 0 (8)", "zero-advantage (3)"]
    assert [(round(p.get_x() + p.get_width() / 2, 3), p.get_height()) for p in ax.patches] == [
        (-0.5, 6),
        (1.5, 2),
        (0.0, 3),
    ]
    many = np.linspace(-2, 2, 40)
    ax = viz.plot_advantages(pd.DataFrame({"advantage": many}), bins=10)
    assert sum(p.get_height() for p in ax.patches[:-1]) == 40
    with pytest.raises(ValueError, match="'advantage' column"):
        viz.plot_advantages(pd.DataFrame({"x": [1]}))


def test_reward_curve_and_loss_weights_write_pngs(tmp_path):
    path = viz.plot_reward_curve([0.1, 0.3, 0.2, 0.6], window=2, path=tmp_path / "r.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    tables = {
        "token-mean": pd.DataFrame({"rollout_id": ["a", "b"], "loss_tokens": [30, 10], "loss_weight": [0.75, 0.25]}),
        "per-rollout": pd.DataFrame({"rollout_id": ["b", "a"], "loss_tokens": [10, 30], "loss_weight": [0.5, 0.5]}),
    }
    ax = viz.plot_loss_weights(tables)
    assert [p.get_height() for p in ax.patches] == [0.75, 0.25, 0.5, 0.5]  # matched by rollout_id


# =========================================================================== browser


def test_browser_static_html_is_a_tree_of_groups_rollouts_and_rows(tok, batch):
    browser = RolloutBrowser(batch, tok, widgets=False)
    assert browser.groups == ["g1", "g2"] and browser.rollouts("g1") == ["r1", "r2"]
    static = browser.static_html()
    assert static.count("<details") == 2 + 3
    assert sum("agl-loss" in c for c, _ in spans_of(static)) == int(batch.data.batch["response_mask"].sum())
    assert static.count('class="agl-diff"') == 1  # r2's merge break is shown under its rows
    assert "<|im_end|>" not in static
    bundle = browser._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert "tokens omitted" in browser.static_html(max_rows=1)


def test_browser_widget_follows_the_selection(tok, batch):
    pytest.importorskip("ipywidgets")
    browser = RolloutBrowser(batch, tok)
    group, rollout, row, pane = browser.widget.children
    assert [v for _, v in group.options] == ["g1", "g2"]
    assert "batch row 0" in pane.value and "agl-diff" not in pane.value
    rollout.value = "r2"
    assert len(row.options) == 2 and "batch row 1" in pane.value and "agl-diff" in pane.value
    row.value = ("r2", 1)
    assert "batch row 2" in pane.value
    group.value = "g2"
    assert rollout.value == "r3" and "batch row 3" in pane.value
    bundle = browser._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "text/html" in bundle


def test_browser_rejects_rollout_results(tok):
    with pytest.raises(TypeError, match="trainer.build_batch"):
        RolloutBrowser(object(), tok)
