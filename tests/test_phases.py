"""The serving state machine (agl_lab.phases): every phase ends itself, also when its body raises.

The recording fakes stand for the engine and the gateway client; the last test drives the same
path through a real Trainer (the local engine, the embedded server, a real runner).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from agl_lab.phases import drain_gateway, rollout_phase, update_phase


class Recorder:
    """An engine and a gateway in one: every call is appended to `calls`."""

    def __init__(self, *, inflight: list[int] | None = None, fail: str | None = None):
        self.calls: list[str] = []
        self._inflight = list(inflight or [0])
        self._fail = fail

    def _call(self, name: str):
        self.calls.append(name)
        if name == self._fail:
            raise RuntimeError(f"{name} failed")

    # engine
    def resume(self):
        self._call("resume")

    def abort(self):
        self._call("abort")
        return 3

    def pause(self, timeout=None, *, reason=None, retry_after_seconds=None):
        if reason is None:  # the engine's pause(timeout)
            self._call("engine.pause")
            return None
        self._call("gateway.pause")
        return SimpleNamespace(inflight=self._inflight.pop(0))

    # gateway
    def proxy_state(self):
        self._call("proxy_state")
        return SimpleNamespace(inflight=self._inflight.pop(0) if self._inflight else 0)


class Gateway(Recorder):
    def resume(self):
        self._call("gateway.resume")


def test_a_sync_phase_aborts_stray_generations_and_reports_them():
    engine, gateway = Recorder(), Gateway()
    with rollout_phase(engine, gateway, drain=False, reason="r", drain_timeout=1) as metrics:
        engine.calls.append("collect")
    assert engine.calls == ["resume", "collect", "abort"] and gateway.calls == []
    assert metrics == {"training/n_aborted_generations": 3}


def test_an_async_phase_drains_the_gateway_until_nothing_is_in_flight():
    engine, gateway = Recorder(), Gateway(inflight=[2, 1, 0])
    with rollout_phase(engine, gateway, drain=True, reason="r", drain_timeout=30) as metrics:
        pass
    assert engine.calls == ["resume"]
    assert gateway.calls == ["gateway.resume", "gateway.pause", "proxy_state", "proxy_state"]
    assert metrics["training/async/proxy_inflight_at_pause"] == 2


@pytest.mark.parametrize("drain", [False, True])
def test_a_collection_that_raises_still_ends_the_phase_and_leaves_the_engine_serving(drain):
    engine, gateway = Recorder(), Gateway()
    with pytest.raises(KeyError, match="collection"):
        with rollout_phase(engine, gateway, drain=drain, reason="r", drain_timeout=1):
            raise KeyError("collection")
    if drain:
        assert gateway.calls == ["gateway.resume", "gateway.pause"]
        assert engine.calls == ["resume", "resume"]
    else:
        assert engine.calls == ["resume", "abort", "resume"]


def test_a_failure_while_ending_a_failed_phase_is_logged_not_raised_over_the_first(caplog):
    engine, gateway = Recorder(fail="abort"), Gateway()
    with caplog.at_level(logging.ERROR, logger="agl_lab.phases"):
        with pytest.raises(KeyError, match="collection"):
            with rollout_phase(engine, gateway, drain=False, reason="r", drain_timeout=1):
                raise KeyError("collection")
    assert engine.calls == ["resume", "abort", "resume"]  # still resumed after the failed abort
    assert "ending the rollout phase after a failed rollout collection also failed" in caplog.text


def test_a_drain_that_never_empties_fails_with_the_key_to_raise():
    gateway = Gateway(inflight=[1] * 1000)
    with pytest.raises(TimeoutError, match="agl_lab.rollout.drain_timeout_seconds"):
        drain_gateway(gateway, reason="r", timeout=0.0)


@pytest.mark.parametrize("pause", [True, False])
def test_an_update_phase_resumes_after_training_a_skip_or_an_error(pause):
    engine = Recorder()
    with update_phase(engine, timeout=5, pause=pause):
        engine.calls.append("train")
    assert engine.calls == (["engine.pause"] if pause else []) + ["train", "resume"]
    engine = Recorder()
    with pytest.raises(ValueError):
        with update_phase(engine, timeout=5, pause=pause):
            raise ValueError("update failed")
    assert engine.calls[-1] == "resume"


def test_a_trainer_whose_collection_raises_can_roll_out_again(monkeypatch, tmp_path):
    """Through the real Trainer: the failed phase aborted, the engine serves, the next rollout works."""
    from agl_lab import Trainer
    from agl_lab.engines.local import LocalEngine

    calls: list[str] = []
    for name in ("abort", "resume"):
        original = getattr(LocalEngine, name)
        monkeypatch.setattr(LocalEngine, name, lambda self, _o=original, _n=name: (calls.append(_n), _o(self))[1])
    overrides = [
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "trainer.total_training_steps=1",
        "agl_lab.model.warm_start_steps=0",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
    ]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=overrides, console=False, run_dir=tmp_path) as trainer:

        def broken(*args, **kwargs):
            raise RuntimeError("the collection broke")

        monkeypatch.setattr(trainer, "_collect_sync", broken)
        with pytest.raises(RuntimeError, match="the collection broke"):
            trainer.rollout()
        assert calls == ["resume", "abort", "resume"]
        monkeypatch.undo()
        ro = trainer.rollout()
        assert len(ro.rollouts) == 4
