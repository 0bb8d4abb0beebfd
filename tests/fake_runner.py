"""A fake runner for the rollout managers' tests: it plays runner + agent in a thread against a real server.

    with FakeRunner(server.url) as runner:    # claims queued rollouts, runs `scripted_agent`, ends them
        ...                                   # a manager creates rollouts and collects them
    post_call(client, rid, prompt, response, logprobs)   # a model_request event as the gateway writes it

The server must accept `KEY` as its admin key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from agl_lab.client import AglClient
from agl_lab.protocol import Rollout

KEY = "test-secret-key"


def post_call(
    client: AglClient,
    rid: str,
    prompt: list[int],
    response: list[int],
    logprobs: list[float],
    *,
    version: int = 0,
    http_status: int = 200,
) -> None:
    """A model_request event exactly as the gateway records it (chat schema)."""
    content = [{"logprob": lp} for lp in logprobs]
    client.add_event(
        rid,
        "0",
        "model_request",
        {
            "model": "test-model",
            "model_version": version,
            "request": {"messages": []},
            "response": {
                "prompt_token_ids": prompt,
                "choices": [{"token_ids": response, "logprobs": {"content": content}}],
            },
            "server": {"model": "test-model", "endpoint": "http://e/v1", "version": version},
            "http_status": http_status,
            "status": "ok" if http_status < 400 else "error",
        },
    )


def reward_of(task: dict, copy_idx: int) -> float:
    return task["x"] * 0.1 + copy_idx


def scripted_agent(client: AglClient, rollout: Rollout) -> str:
    """Two calls (prompt grows), then reward; FAILED when the task says so."""
    task, k, rid = rollout.input, rollout.metadata.copy_idx, rollout.rollout_id
    post_call(client, rid, [task["x"], k], [100 + k], [-0.5], version=task.get("v", 0) + 1)
    post_call(client, rid, [task["x"], k, 100 + k, 7], [200 + k, 201], [-0.25, -0.75], version=task.get("v", 0))
    client.add_event(rid, "0", "reward", {"value": reward_of(task, k)})
    return "failed" if task.get("fail") else "succeeded"


class FakeRunner:
    """Claims queued rollouts (highest `priority` first), runs `agent`, patches the state.

    Tasks named in `hold` stay queuing; with `(name, copy_idx)` entries only that copy waits.
    """

    def __init__(
        self,
        url: str,
        agent: Callable[[AglClient, Rollout], str] = scripted_agent,
        hold: set | None = None,
        priority: Callable[[Rollout], int] | None = None,
    ):
        self.client = AglClient(url, key=KEY, backoff_base=0.001)
        self.agent, self.hold, self.priority = agent, hold if hold is not None else set(), priority
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _held(self, r: Rollout) -> bool:
        name = r.input.get("name")
        return name in self.hold or (name, r.metadata.copy_idx) in self.hold

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                queued = [r for r in self.client.list_rollouts(["queuing"], limit=10_000) if not self._held(r)]
                for r in sorted(queued, key=self.priority or (lambda r: 0)):
                    self.client.patch_status(r.rollout_id, state="running", last_attempt_id="0")
                    state = self.agent(self.client, r)
                    extra = {"error_message": "agent gave up"} if state == "failed" else {}
                    self.client.patch_status(r.rollout_id, state=state, **extra)
            except BaseException as exc:  # surfaced by close()
                self.errors.append(exc)
                return
            time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()
        if self.errors:
            raise self.errors[0]

    def __enter__(self) -> FakeRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
