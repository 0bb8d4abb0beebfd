"""Config composition: AGL configs load unchanged; typos and contradictions fail clearly."""

import pytest

from agl_lab.config import ConfigError, default_config, load_config, trace_limits

FIXTURE = "tests/fixtures/agl_calc_x.yaml"


def test_agl_calc_x_config_loads_unchanged():
    cfg = load_config(FIXTURE)
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.3
    assert cfg.agentlightning.local.env_map.QUESTION == "input.question"
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.tool_call_parser == "hermes"
    # AGL's own defaults survive underneath the example's overrides
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "per_rollout_mean"
    assert cfg.algorithm.enable_rollout_level_advantage is True
    assert cfg.agentlightning.trace_aggregator.level == "trajectory"
    assert trace_limits(cfg) == (2048, 8192)


def test_agl_defaults_match_upstream_table():
    cfg = default_config()
    agl = cfg.agentlightning
    assert agl.agl_base_url == "http://localhost:8080"
    assert agl.rollout_timeout_seconds == 1800
    assert agl.reward_fillna_value == 0.0
    assert agl.max_ppo_update_times is None
    assert agl.async_rollout.enabled is False and agl.async_rollout.async_train_batch_size is None
    assert cfg.actor_rollout_ref.rollout.mode == "async"
    assert cfg.actor_rollout_ref.actor.clip_ratio_c == 3.0


def test_unknown_key_names_the_key_and_suggests_the_fix():
    with pytest.raises(ConfigError, match=r"data\.train_batchsize.*did you mean 'data\.train_batch_size'"):
        load_config(None, ["data.train_batchsize=8"])
    with pytest.raises(ConfigError, match=r"agl_lab\.enigne"):
        load_config({"agl_lab": {"enigne": "local"}})


def test_free_form_subtrees_accept_any_key():
    cfg = load_config(None, ["actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs=8",
                             "agentlightning.local.env_map.X=input.x"])
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs == 8


@pytest.mark.parametrize("overrides, message", [
    (["agentlightning.async_rollout.enabled=true"], r"async_train_batch_size \(None\) must be > data\.train_batch_size"),
    (["agentlightning.async_rollout.enabled=true", "data.train_batch_size=8",
      "agentlightning.async_rollout.async_train_batch_size=8"], r"\(8\) must be > data\.train_batch_size \(8\)"),
    (["algorithm.adv_estimator=gae"], r"adv_estimator=gae"),
    (["algorithm.adv_estimator=remax"], r"remax is not supported"),
    (["agl_lab.engine=tpu"], r"agl_lab\.engine='tpu' is not one of"),
    (["agl_lab.algorithm.normalize_by=tokens"], r"normalize_by"),
    (["agentlightning.trace_aggregator.level=segment"], r"trace_aggregator\.level"),
    (["algorithm.rollout_correction.bypass_mode=true", "agl_lab.server.include_log_probs=false"],
     r"bypass_mode=true needs sampling logprobs"),
    (["data.train_batch_size"], r"is not key=value"),
    (["agl_lab.algorithm.small_batch=never"], r"agl_lab\.algorithm\.small_batch='never' is not one of"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=0"], r"ppo_mini_batch_size"),
])
def test_contradictions_fail_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_learning_rules_have_one_message_the_pure_modules():
    """config.py calls the checks of the modules that apply each rule: same text, one place."""
    from agl_lab.algorithms import check_divisor, check_estimator
    from agl_lab.batch import check_level

    for override, check in ((["agl_lab.algorithm.normalize_by=tokens"], lambda: check_divisor("tokens")),
                            (["agentlightning.trace_aggregator.level=segment"], lambda: check_level("segment")),
                            (["algorithm.adv_estimator=gae"], lambda: check_estimator("gae"))):
        with pytest.raises(ValueError) as pure:
            check()
        with pytest.raises(ConfigError) as composed:
            load_config(None, override)
        assert str(composed.value) == str(pure.value)


def test_missing_file_is_a_clear_error():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config("nope.yaml")
