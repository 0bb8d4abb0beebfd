"""Engines own the policy weights and the OpenAI-compatible inference endpoints."""
