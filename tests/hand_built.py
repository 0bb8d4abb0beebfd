"""Hand-built inputs for the tests of the learning side: rollouts, a tokenizer, a tiny model.

T([1, 2], [3, 4])                    # a Triplet: prompt ids, response ids, logprobs -0.1 each
R("r0", [T(...), T(...)], reward=1)  # a CompletedRollout of those calls (data_id "d")
SpaceTokenizer().decode([1, 2])      # "1 2": the upstream tests' fake tokenizer
mixed_rollouts()                     # 6 rollouts over 2 groups and 2 steps, half with a merge break
tiny_qwen2()                         # a real Qwen2 from a config: 2 layers, hidden 64, vocab 300, seed 0
"""

from __future__ import annotations

from agl_lab.records import CompletedRollout, Triplet


class SpaceTokenizer:
    """The upstream tests' fake tokenizer: decode = space-joined ids."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def lp(n: int) -> list[float]:
    return [-0.1] * n


def T(prompt, response, logprobs="auto") -> Triplet:
    return Triplet(list(prompt), list(response), lp(len(response)) if logprobs == "auto" else logprobs)


def R(rid, triplets, reward=1.0, data_id="d", step=0, sample_idx=0) -> CompletedRollout:
    return CompletedRollout(
        rollout_id=rid, data_id=data_id, step=step, sample_idx=sample_idx, triplets=triplets, final_reward=reward
    )


def mixed_rollouts() -> list[CompletedRollout]:
    """6 rollouts of two calls each (the second extends the first); the odd ones add a third call
    that does not (a merge break). Groups g0, g1 of 3; steps alternate 0, 1."""
    out = []
    for k in range(6):
        calls = [T([k, 1], [2]), T([k, 1, 2, 3], [4, 5])]
        if k % 2:
            calls.append(T([99, k], [7]))  # a break
        out.append(R(f"r{k}", calls, reward=float(k), data_id=f"g{k // 3}", step=k % 2, sample_idx=k // 3))
    return out


def tiny_qwen2():
    """A real Qwen2ForCausalLM built from a config (2 layers, hidden 64, vocab 300; weights seeded 0), in eval mode."""
    import torch  # here, not above: the rollouts alone load neither torch nor transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()
