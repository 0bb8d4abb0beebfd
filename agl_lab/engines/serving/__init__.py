"""The local engine's OpenAI serving stack: routes, a continuous-batching scheduler, the decode step.

`openai_server` (the vLLM-compatible chat route that returns token ids and logprobs) →
`scheduler` (admits requests into one running batch, aborts, pauses) → `decode_batch` (one
batched forward per step over a ragged KV cache) with `fast_decode` (the attention fast path)
and `prefix_cache` (shared prompt prefixes across the calls of one rollout).
"""
