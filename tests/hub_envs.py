"""An OpenEnv environment written as its authors document one, for tests/test_hubs.py to run in
process (`agl_lab.task.name=openenv:tests.hub_envs:HotCold`).

HotCold hides a number from 1 to 9 (drawn from the reset seed). Each guess is one step: the right
number ends the episode with reward 1.0; any other reply costs 0.1 and says "higher", "lower" or
that it held no number — a mid-episode reward on every step.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

RULES = "Guess the hidden number from 1 to 9. Reply with one number."


class Guess(Action):
    text: str


class Hint(Observation):
    prompt: str


class HotCold(Environment[Guess, Hint, State]):
    def __init__(self, low: int = 1, high: int = 9) -> None:
        super().__init__()
        self.low, self.high = low, high
        self._state = State()
        self._target = low

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Hint:
        self._target = random.Random(seed).randint(self.low, self.high)
        self._state = State(episode_id=episode_id, step_count=0)
        return Hint(prompt=RULES.replace("1 to 9", f"{self.low} to {self.high}"))

    def step(self, action: Guess, timeout_s: float | None = None, **kwargs: Any) -> Hint:
        self._state.step_count += 1
        found = re.findall(r"-?\d+", action.text)
        if not found:
            return Hint(prompt="No number in your reply. Reply with one number.", reward=-0.1)
        guess = int(found[-1])
        if guess == self._target:
            return Hint(prompt="Right.", reward=1.0, done=True)
        return Hint(prompt="higher" if guess < self._target else "lower", reward=-0.1)

    @property
    def state(self) -> State:
        return self._state
