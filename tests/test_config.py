"""Config composition: AGL configs load unchanged; typos and contradictions fail clearly."""

import re
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from agl_lab.config import ConfigError, ConfigWarning, default_config, load_config, trace_limits

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
    cfg = load_config(
        None, ["actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs=8", "agentlightning.local.env_map.X=input.x"]
    )
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["agentlightning.async_rollout.enabled=true"],
            r"async_train_batch_size \(None\) must be an int > data\.train_batch_size",
        ),
        (
            [
                "agentlightning.async_rollout.enabled=true",
                "data.train_batch_size=8",
                "agentlightning.async_rollout.async_train_batch_size=8",
            ],
            r"\(8\) must be an int > data\.train_batch_size \(8\)",
        ),
        (["algorithm.adv_estimator=gae"], r"adv_estimator=gae"),
        (["algorithm.adv_estimator=remax"], r"remax is not supported"),
        (["agl_lab.engine=tpu"], r"agl_lab\.engine='tpu' is not one of"),
        (["agl_lab.algorithm.normalize_by=tokens"], r"normalize_by"),
        (["agentlightning.trace_aggregator.level=segment"], r"trace_aggregator\.level"),
        (
            ["algorithm.rollout_correction.bypass_mode=true", "agl_lab.server.include_log_probs=false"],
            r"bypass_mode=true needs sampling logprobs",
        ),
        (["data.train_batch_size"], r"is not key=value"),
        (["agl_lab.algorithm.small_batch=never"], r"agl_lab\.algorithm\.small_batch='never' is not one of"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=0"], r"ppo_mini_batch_size"),
    ],
)
def test_contradictions_fail_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_learning_rules_have_one_message_the_pure_modules():
    """config.py calls the checks of the modules that apply each rule: same text, one place."""
    from agl_lab.algorithms import check_divisor, check_estimator
    from agl_lab.batch import check_level

    for override, check in (
        (["agl_lab.algorithm.normalize_by=tokens"], lambda: check_divisor("tokens")),
        (["agentlightning.trace_aggregator.level=segment"], lambda: check_level("segment")),
        (["algorithm.adv_estimator=gae"], lambda: check_estimator("gae")),
    ):
        with pytest.raises(ValueError) as pure:
            check()
        with pytest.raises(ConfigError) as composed:
            load_config(None, override)
        assert str(composed.value) == str(pure.value)


def test_missing_file_is_a_clear_error():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config("nope.yaml")


# ---------------------------------------------------------------------------------------------
# Issue #12: wrong type/range fails naming the key; every key works or warns once
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.train_batch_size=abc", r"data\.train_batch_size must be an integer, got 'abc'"),
        ("data.train_batch_size=-3", r"data\.train_batch_size must be > 0, got -3"),
        ("actor_rollout_ref.actor.optim.lr=fast", r"actor_rollout_ref\.actor\.optim\.lr must be a number, got 'fast'"),
        ("trainer.val_before_train=maybe", r"trainer\.val_before_train must be true or false"),
        ("actor_rollout_ref.rollout.temperature=0", r"rollout\.temperature must be > 0"),
        ("agl_lab.rollout.wait_timeout_seconds=soon", r"wait_timeout_seconds='soon'"),
        # the embedded server's limits: checked at load by ServerConfig's own rules
        (
            "agl_lab.server.lease_seconds=-1",
            r"agl_lab\.server\.lease_seconds=-1: Input should be greater than or equal to 0",
        ),
        (
            "agl_lab.server.max_attempts=0",
            r"agl_lab\.server\.max_attempts=0: Input should be greater than or equal to 1",
        ),
        ("agl_lab.server.upstream_client=curl", r"agl_lab\.server\.upstream_client='curl': Input should be 'auto'"),
        ("agl_lab.server.max_body_bytes=big", r"agl_lab\.server\.max_body_bytes='big'"),
        # keys whose default is null: their type comes from the TYPED table
        ("trainer.total_training_steps=ten", r"trainer\.total_training_steps must be an integer, got 'ten'"),
        ("trainer.total_training_steps=0", r"trainer\.total_training_steps must be > 0, got 0"),
        ("agentlightning.max_ppo_update_times=many", r"agentlightning\.max_ppo_update_times must be an integer"),
        ("agl_lab.runner.agent_timeout_seconds=soon", r"agl_lab\.runner\.agent_timeout_seconds must be a number"),
        (
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean",
            r"actor_rollout_ref\.actor\.loss_agg_mode='seq-mean' is not one of verl's modes \['token-mean'",
        ),
    ],
)
def test_wrong_type_or_range_fails_at_load_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_every_typed_key_with_a_null_default_is_a_real_key_and_rejects_a_word():
    from agl_lab.config import default_config
    from agl_lab.config_keys import TYPED

    defaults = default_config()
    for key, (_, _words) in TYPED.items():
        assert OmegaConf.select(defaults, key, default="MISSING") != "MISSING", key
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_config(None, [f"{key}=notanumber"])
    cfg = load_config(None, ["trainer.total_training_steps=10", "actor_rollout_ref.actor.entropy_coeff=0.01"])
    assert cfg.trainer.total_training_steps == 10 and cfg.actor_rollout_ref.actor.entropy_coeff == 0.01


def test_loss_agg_mode_under_per_rollout_mean_warns_it_has_no_effect():
    import warnings

    from agl_lab.config import ConfigWarning

    with pytest.warns(
        ConfigWarning,
        match=r"actor_rollout_ref\.actor\.loss_agg_mode=seq-mean-token-mean has no "
        r"effect under actor_rollout_ref\.actor\.policy_loss\.loss_mode=per_rollout_mean",
    ):
        load_config(None, ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"])
    for used in (
        ["actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"],  # verl's aggregation reads it
        ["actor_rollout_ref.actor.entropy_coeff=0.01"],
    ):  # it aggregates the entropy term
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_config(None, ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", *used])
        assert not [w for w in caught if "loss_agg_mode" in str(w.message)], used


def test_grpo_with_one_rollout_per_task_warns():
    from agl_lab.config import ConfigWarning

    with pytest.warns(ConfigWarning, match=r"actor_rollout_ref\.rollout\.n=1 with algorithm\.adv_estimator=grpo"):
        load_config(None, ["actor_rollout_ref.rollout.n=1"])


def test_keys_without_effect_on_the_local_engine_warn_once_each_naming_the_key():
    import warnings

    from agl_lab.config import ConfigWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(FIXTURE, ["agl_lab.engine=local"])
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    no_effect = [m for m in messages if "has no effect" in m]
    for key in (
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.tool_call_parser",
        "agentlightning.agl_base_url",
    ):
        assert sum(m.startswith(key + " ") for m in no_effect) == 1, key
    # keys the local engine reads never warn
    for key in (
        "data.train_batch_size",
        "actor_rollout_ref.actor.optim.lr",
        "actor_rollout_ref.rollout.n",
        "trainer.save_freq",
        "actor_rollout_ref.actor.clip_ratio_high",
    ):
        assert not any(m.startswith(key + " ") for m in no_effect), key
    # the verl engine reads them all: no "local engine" warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(FIXTURE, ["agl_lab.engine=verl"])
    assert not [w for w in caught if "local engine" in str(w.message)]


def test_wait_timeout_auto_null_and_a_short_value():
    from agl_lab.config import ConfigWarning, rollout_wait_timeout

    assert rollout_wait_timeout(load_config(None)) == 1800 + 60  # auto: rollout timeout + 60 s
    assert rollout_wait_timeout(load_config(None, ["agl_lab.rollout.wait_timeout_seconds=null"])) is None
    with pytest.warns(
        ConfigWarning, match=r"wait_timeout_seconds=600 is shorter than agentlightning\.rollout_timeout_seconds=1800"
    ):
        cfg = load_config(None, ["agl_lab.rollout.wait_timeout_seconds=600"])
    assert rollout_wait_timeout(cfg) == 600


def test_actor_model_path_names_the_model_of_the_local_engine(tmp_path):
    cfg = load_config(FIXTURE)
    assert cfg.agl_lab.model.path == "Qwen/Qwen2.5-1.5B-Instruct"  # never silently the tiny model
    assert load_config(None).agl_lab.model.path is None  # verl's placeholder default is not adopted
    with pytest.raises(ConfigError, match="name different models"):
        load_config(FIXTURE, ["agl_lab.model.path=/elsewhere"])


def test_embedded_server_keys_warn_when_the_server_is_external():
    from agl_lab.config import ConfigWarning

    with pytest.warns(
        ConfigWarning,
        match=r"agl_lab\.server\.lease_seconds has no effect with "
        r"agl_lab\.server\.embedded=false",
    ) as caught:
        load_config(
            None,
            [
                "agl_lab.server.embedded=false",
                "agl_lab.server.lease_seconds=60",
                "agentlightning.agl_base_url=http://127.0.0.1:9",
            ],
        )
    assert not any("agl_base_url has no effect" in str(w.message) for w in caught)  # it is what the run uses


def test_local_engine_keys_warn_on_the_verl_engine_naming_what_verl_reads():
    import warnings

    from agl_lab.config import ConfigWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(
            None,
            [
                "agl_lab.engine=verl",
                "agl_lab.engine_options.max_batch_size=8",
                "agl_lab.model.max_model_len=4096",
                "agl_lab.model.device=cpu",
                "agl_lab.model.warm_start_steps=10",
            ],
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    verl = [m for m in messages if "has no effect on the verl engine" in m]
    assert [m.split(" ")[0] for m in verl] == [
        "agl_lab.engine_options.max_batch_size",
        "agl_lab.model.max_model_len",
        "agl_lab.model.device",
    ]
    assert "actor_rollout_ref.rollout.max_model_len" in verl[1]
    with warnings.catch_warnings(record=True) as caught:  # the local engine reads them: silent
        warnings.simplefilter("always")
        load_config(None, ["agl_lab.engine_options.max_batch_size=8", "agl_lab.model.max_model_len=4096"])
    assert not [w for w in caught if "has no effect" in str(w.message)]


def test_a_lease_not_below_the_rollout_wait_warns_naming_both_keys():
    import warnings as warnings_mod

    from agl_lab.config import ConfigWarning

    with pytest.warns(
        ConfigWarning,
        match=r"agl_lab\.server\.lease_seconds=120 is not below the trainer's rollout "
        r"wait \(100 s, agl_lab\.rollout\.wait_timeout_seconds\)",
    ):
        load_config(
            None,
            [
                "agl_lab.server.lease_seconds=120",
                "agl_lab.rollout.wait_timeout_seconds=100",
                "agentlightning.rollout_timeout_seconds=50",
            ],
        )
    with warnings_mod.catch_warnings(record=True) as seen:
        warnings_mod.simplefilter("always")
        load_config(None, ["agl_lab.server.lease_seconds=30"])  # below the auto wait (1860 s): quiet
    assert not [w for w in seen if "lease_seconds" in str(w.message)]


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_config_loads_without_a_warning(path, recwarn):
    cfg = load_config(path)
    assert cfg.trainer.experiment_name
    assert not [w for w in recwarn if "agl_lab" in w.filename or issubclass(w.category, ConfigWarning)], [
        str(w.message) for w in recwarn
    ]


def test_zero_advantage_skip_set_where_it_is_not_exact_warns():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, ["agl_lab.algorithm.skip_zero_advantage=true", "actor_rollout_ref.actor.entropy_coeff=0.01"])
        load_config(None, ["agl_lab.engine=verl", "agl_lab.algorithm.skip_zero_advantage=false"])
        load_config(None, ["agl_lab.engine=verl", "actor_rollout_ref.actor.use_prefix_grouper=true"])
        load_config(None, ["actor_rollout_ref.actor.use_prefix_grouper=true"])  # the local engine honours it
        load_config(None, ["agl_lab.algorithm.skip_zero_advantage=true"])  # exact here: silent
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    skip = [m for m in messages if m.startswith("agl_lab.algorithm.skip_zero_advantage")]
    assert len(skip) == 2
    assert "entropy_coeff=0.01 is non-zero for every row" in skip[0] and "has no effect" in skip[0]
    assert "has no effect on the verl engine" in skip[1]
    grouper = [m for m in messages if "use_prefix_grouper" in m]
    assert len(grouper) == 1 and "verl engine" in grouper[0] and "agl_lab.engine=local" in grouper[0]
    with pytest.raises(ConfigError, match="agl_lab.algorithm.skip_zero_advantage must be true or false"):
        load_config(None, ["agl_lab.algorithm.skip_zero_advantage=maybe"])


def test_task_tools_outside_reasoning_gym_warns_that_it_has_no_effect():
    with pytest.warns(ConfigWarning, match=r"agl_lab\.task\.tools has no effect on agl_lab\.task\.name=calc"):
        load_config(None, ["agl_lab.task.name=calc", "agl_lab.task.tools=[calculator]"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(None, ["agl_lab.task.name=calc", "actor_rollout_ref.rollout.n=4"])  # not set: nothing said
