"""Seeded calls: a call's seed depends on its position in the run, never on arrival order."""

from agl_lab.protocol import RolloutCreate
from agl_lab.server.gateway import ProxyCall
from agl_lab.server.seeding import SeededCallsRewriter, derive_seed


def _call(rollout, body=None):
    return ProxyCall(
        rollout=rollout,
        attempt_id="0",
        mode="train",
        upstream_path="chat/completions",
        server=None,
        request=dict(body or {}),
        store=None,
    )


def _rollout(copy_idx, rid):
    meta = {"batch_idx": 3, "sample_idx_in_batch": 1, "copy_idx": copy_idx}
    return RolloutCreate(input={}, metadata=meta, rollout_id=rid).to_rollout()


def test_seed_follows_position_not_rollout_id_or_order():
    a, b = SeededCallsRewriter(7), SeededCallsRewriter(7)
    first = [_call(_rollout(0, "x")) for _ in range(2)]
    for call in first:
        a(call)
    other_id = [_call(_rollout(0, "y")) for _ in range(2)]
    b(_call(_rollout(1, "z")))  # another rollout interleaved first changes nothing
    for call in other_id:
        b(call)
    assert [c.request["seed"] for c in first] == [c.request["seed"] for c in other_id]
    assert first[0].request["seed"] != first[1].request["seed"]  # turn 2 ≠ turn 1
    assert first[0].annotations["call_seed"] == first[0].request["seed"]


def test_copies_of_a_task_get_different_seeds_and_an_agent_seed_wins():
    rw = SeededCallsRewriter(7)
    c0, c1, own = _call(_rollout(0, "p")), _call(_rollout(1, "q")), _call(_rollout(2, "r"), {"seed": 5})
    for call in (c0, c1, own):
        rw(call)
    assert c0.request["seed"] != c1.request["seed"]
    assert own.request["seed"] == 5
    assert derive_seed(7, (3, 1, 0, "0", 0)) == c0.request["seed"]
