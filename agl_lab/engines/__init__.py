"""Engines own the policy weights and the OpenAI-compatible inference endpoints.

`base` declares the contract (and the batch schema every engine reads); `local` (with
`local_ppo` for the update and `tiny` for the built-in model) is the in-process torch engine,
served by `serving/`; `verl/` drives verl's worker groups and rollout replicas.
"""
