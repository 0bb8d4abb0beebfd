"""`format_transcript` (what `Trainer.dry_run` prints) and the token renderings' escaping."""

from __future__ import annotations

from agl_lab.records import CompletedRollout, Triplet
from agl_lab.transcript import format_transcript
from agl_lab.viz import _visible, plot_architecture


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(96 + i) if i > 0 else "\x1d" for i in ids)


def _rollout(triplets, **kw):
    return CompletedRollout(rollout_id="r1", data_id="d1", step=0, sample_idx=0, triplets=triplets, **kw)


def test_new_prompt_tokens_only_when_the_prompt_extends_the_context():
    r = _rollout([Triplet([1, 2], [3]), Triplet([1, 2, 3, 4], [5, 6]), Triplet([9], [0])], final_reward=0.5)
    text = format_transcript(r, _Tok())
    lines = text.splitlines()
    assert lines[0] == "rollout r1 · task d1 · 3 calls"
    assert lines[1] == "call 0 · prompt 2 tokens · response 1 tokens" and lines[2] == "  ▸ ab"
    assert lines[4] == "call 1 · prompt 4 tokens (+1 new) · response 2 tokens" and lines[5] == "  ▸ d"
    assert "does not extend the previous context" in lines[7] and lines[8] == "  ▸ i"
    assert lines[9] == "  ◂ \\x1d"  # control characters are escaped, one line per turn
    assert lines[-1] == "reward 0.500 · succeeded"


def test_a_failed_rollout_shows_its_error():
    text = format_transcript(_rollout([], state="failed", error_message="agent raised ValueError: x"))
    assert text.endswith("reward None · failed\nerror: agent raised ValueError: x")


def test_token_pieces_escape_control_characters(tmp_path):
    assert _visible("a\x1db\x7f\tc\n") == "a\\x1db\\x7f⇥c↵\n"
    assert plot_architecture(path=tmp_path / "arch.png").stat().st_size > 1000
