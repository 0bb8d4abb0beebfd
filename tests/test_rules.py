"""Every learning rule has one home, `agl_lab/rules.py`, and one message.

- Each rule's message template is written once in `agl_lab/`, in `rules.py`: the modules that
  apply a rule (batch, algorithms, rollout, update) and `config.validate` call its check, never
  re-raise it in their own words. Every `check_*` of `rules.py` has its messages in `RULES`.
- The callers raise the rule's own message: the batch builder, the update pipeline, the async
  manager and `load_config` say the same thing for the same mistake.
- The parity rule (`drop_order=agl` skips a batch under one mini-batch, as AGL v1 does) makes the
  update's skip decision agree with AGL v1's alignment.
- `agl_lab.config` checks the async sizes without importing the rollout module.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from agl_lab import rules

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "agl_lab").rglob("*.py"))}

# (check, arguments that break the rule, a piece of its message template as written in the source)
RULES = [
    ("check_level", ("segment",), "Unknown trace_aggregator_level: {level!r}"),
    ("check_divisor", ("tokens",), "agl_lab.algorithm.normalize_by={divisor!r} is not one of"),
    ("check_turn_credit", ("steps", 1.0, "transition"), "agl_lab.algorithm.turn_credit={turn_credit!r} is not one of"),
    ("check_turn_credit", ("return", 1.5, "transition"), "agl_lab.algorithm.turn_gamma must be in [0, 1], got"),
    (
        "check_turn_credit",
        ("return", 1.0, "trajectory"),
        "agl_lab.algorithm.turn_credit=return credits each transition with its own return: set ",
    ),
    (
        "check_turn_credit",
        ("return", 1.0, "transition", True),
        "agl_lab.algorithm.turn_credit=return gives the rows of one rollout different rewards, which ",
    ),
    ("check_drop_order", ("later",), "agl_lab.parity.drop_order={drop_order!r} is not one of"),
    ("check_async_sizes", (0, 2), "data.train_batch_size must be an int >= 1, got"),
    (
        "check_async_sizes",
        (4, 4),
        "agentlightning.async_rollout.async_train_batch_size ({async_train_batch_size!r}) must be an int > ",
    ),
    (
        "check_async_sizes",
        (4, 3, 1),
        "agentlightning.async_rollout.async_train_batch_size ({async_train_batch_size!r}) must be an int >= ",
    ),
    ("check_overlap", (-1, "drop"), "agl_lab.rollout.max_staleness={max_staleness!r}: use an int >= 0 (policy "),
    ("check_overlap", (1, "later"), "agl_lab.rollout.stale_groups={stale_groups!r} is not one of"),
    ("check_overlap", (1, "drop", "verl"), "agl_lab.rollout.max_staleness={max_staleness} overlaps generation with "),
    (
        "check_overlap",
        (1, "drop", "local", False),
        "agl_lab.rollout.max_staleness={max_staleness} needs the carry-over ",
    ),
    ("check_compute_dtype", ("float16",), "agl_lab.model.compute_dtype={value!r} is not one of null, "),
    ("check_estimator", ("remax",), "algorithm.adv_estimator=remax is not supported (as in AGL v1)"),
    (
        "check_estimator",
        ("gae",),
        "algorithm.adv_estimator={name} gives token-varying advantages, which rollout-level ",
    ),
    ("check_selection_args", (0,), "mini_batch_rows must be positive (actor.ppo_mini_batch_size × rollout.n), got"),
    ("check_selection_args", (4, 0), "agentlightning.max_ppo_update_times must be null or a positive integer, got"),
    ("check_selection_args", (4, None, "first"), "policy={policy!r} is not one of"),
    ("check_selection_args", (4, None, "zero_adv_first", "never"), "agl_lab.algorithm.small_batch={small_batch!r}"),
]
IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(RULES)]


def _pattern(template: str) -> str:
    """The template's literal text as a regex, each `{placeholder}` matching anything."""
    return ".*".join(re.escape(piece) for piece in re.split(r"\{[^{}]*\}", template))


@pytest.mark.parametrize(("name", "args", "template"), RULES, ids=IDS)
def test_each_rule_message_is_written_once_in_rules_py(name, args, template):
    homes = {path: text.count(template) for path, text in SOURCES.items() if template in text}
    assert homes == {"agl_lab/rules.py": 1}


@pytest.mark.parametrize(("name", "args", "template"), RULES, ids=IDS)
def test_each_rule_raises_its_message(name, args, template):
    with pytest.raises((ValueError, NotImplementedError), match=_pattern(template)):
        getattr(rules, name)(*args)


def test_under_overlap_one_batch_in_flight_is_enough_and_a_deeper_buffer_is_named():
    """At staleness N a group enqueued during an update waits ~buffer/batch steps; past N it ages out:
    the buffer may be one batch (the next generates while this trains) up to N batches."""
    rules.check_async_sizes(4, 4, 1)  # the pipeline: no error
    with pytest.raises(ValueError, match=r"must be an int > data.train_batch_size \(4\) when async"):
        rules.check_async_sizes(4, 4, 0)  # without overlap AGL's rule: something to carry over
    assert rules.overlap_buffer_excess(4, 4, 1) is None and rules.overlap_buffer_excess(4, 8, 2) is None
    assert rules.overlap_buffer_excess(4, 8, 0) is None  # no overlap, nothing ages out
    excess = rules.overlap_buffer_excess(4, 8, 1)
    assert excess.startswith(
        "agentlightning.async_rollout.async_train_batch_size=8 with agl_lab.rollout.max_staleness=1"
    )
    assert excess.endswith("set it to 4 (max_staleness × train_batch_size)")


def test_load_config_warns_for_a_buffer_deeper_than_the_staleness_bound():
    from agl_lab.config import ConfigWarning, load_config

    overlap = ["agentlightning.async_rollout.enabled=true", "agl_lab.rollout.max_staleness=1"]
    overlap += [
        "algorithm.rollout_correction.bypass_mode=true",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
    ]
    with pytest.warns(ConfigWarning, match=r"async_train_batch_size=8 with .* groups age out"):
        load_config(None, [*overlap, "agentlightning.async_rollout.async_train_batch_size=8"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(None, [*overlap, "agentlightning.async_rollout.async_train_batch_size=4"])


def test_every_check_of_rules_py_has_its_messages_listed():
    checks = {name for name in vars(rules) if name.startswith("check_") and callable(getattr(rules, name))}
    assert checks == {name for name, _, _ in RULES}


# ---------------------------------------------------------------------------------------------
# The callers raise the rule's message
# ---------------------------------------------------------------------------------------------


def test_the_batch_builder_raises_the_turn_credit_rule():
    from agl_lab.batch import plan_rows

    with pytest.raises(ValueError, match="turn_credit=return credits each transition with its own return"):
        plan_rows([], "trajectory", turn_credit="return")
    with pytest.raises(ValueError, match=r"turn_credit='steps' is not one of \['rollout', 'return'\]"):
        plan_rows([], "transition", turn_credit="steps")
    assert plan_rows([], "transition", turn_credit="return").rows == []  # the advantage mode is config's to check


def test_the_update_pipeline_raises_the_drop_order_rule():
    from agl_lab.algorithms import prepare_update_batch
    from tests.algo_batches import one_row_rollouts

    with pytest.raises(ValueError, match=r"drop_order='later' is not one of \['after_advantage', 'agl'\]: "):
        prepare_update_batch(one_row_rollouts({"a": [1, 0]}), mini_batch_rows=2, drop_order="later")


@pytest.mark.parametrize(
    ("overrides", "template"),
    [
        (["agl_lab.parity.drop_order=later"], "agl_lab.parity.drop_order={drop_order!r} is not one of"),
        (
            ["agentlightning.async_rollout.enabled=true", "agentlightning.async_rollout.async_train_batch_size=1"],
            "agentlightning.async_rollout.async_train_batch_size ({async_train_batch_size!r}) must be an int > ",
        ),
        (["agl_lab.algorithm.turn_credit=return"], "turn_credit=return credits each transition with its own return"),
    ],
)
def test_load_config_raises_the_rules_message(overrides, template):
    from agl_lab.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=_pattern(template)):
        load_config("configs/cpu_tiny.yaml", overrides)


def test_config_checks_the_async_sizes_without_the_rollout_module():
    code = (
        "import json, sys, warnings\nwarnings.simplefilter('ignore')\nfrom agl_lab.config import load_config\n"
        "load_config('configs/cpu_tiny.yaml', ['agentlightning.async_rollout.enabled=true',"
        " 'agentlightning.async_rollout.async_train_batch_size=64'])\n"
        "print(json.dumps('agl_lab.rollout' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False


# ---------------------------------------------------------------------------------------------
# The parity rule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("small_batch", rules.SMALL_BATCH_CHOICES)
def test_agl_drop_order_skips_a_small_batch_whatever_small_batch_says(small_batch):
    assert rules.small_batch_under("agl", small_batch) == "skip"
    assert rules.small_batch_under("after_advantage", small_batch) == small_batch
    with pytest.raises(ValueError, match=r"agl_lab\.parity\.drop_order='later'"):
        rules.small_batch_under("later", small_batch)


@pytest.mark.parametrize("drop_order", rules.DROP_ORDERS)
@pytest.mark.parametrize("small_batch", rules.SMALL_BATCH_CHOICES)
def test_the_skip_decision_agrees_with_the_selection(drop_order, small_batch):
    # 3 rows under one mini-batch of 4: run_update's skip decision (row counts and the parity
    # rule) says what prepare_update_batch then does with the same rows
    from agl_lab.algorithms import prepare_update_batch, skip_reason
    from tests.algo_batches import one_row_rollouts

    skips = skip_reason(3, 4, rules.small_batch_under(drop_order, small_batch)) is not None
    data = one_row_rollouts({"a": [1, 0, 1]})
    prepared, _, metrics = prepare_update_batch(
        data, mini_batch_rows=4, num_repeat=3, drop_order=drop_order, small_batch=small_batch
    )
    assert (prepared is None) == skips == bool(metrics["training/skipped_steps"])
    assert skips == (drop_order == "agl" or small_batch == "skip")
