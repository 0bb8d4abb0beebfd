"""The verl engine: verl's RayPPOTrainer worker groups and rollout replicas behind the Engine contract.

`engine` (VerlEngine, the phases in order) → `trainer` (the verl-side classes) → `api` (every
verl/vLLM symbol used, checked by a contract test); `cpu` and `cpu_rollout` run the same code
on a machine without CUDA. Importing this package imports neither verl, torch, Ray nor vLLM.
"""
