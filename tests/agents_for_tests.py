"""Agents the runner tests run: AGL agent classes (for subprocesses) and one multi-turn episode.

Every class follows the Agent Lightning contract: no-argument constructor, `run()` (sync or
async), task from environment variables, reward POSTed to `AGL_EVENT_URL`. They report what
they saw as events so the tests assert on the store, the way a user would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

OBSERVATION = "Observation: the calculator says 42."


def _post_event(event_type: str, data: dict) -> None:
    key = os.environ["AGL_KEY"]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = httpx.post(
        os.environ["AGL_EVENT_URL"], json={"event_type": event_type, "data": data}, headers=headers, timeout=10
    )
    resp.raise_for_status()


class EnvReportAgent:
    """Posts its AGL_* and T_* environment as an `env` event, then reward 1.0."""

    def run(self) -> None:
        env = {k: v for k, v in os.environ.items() if k.startswith(("AGL_", "T_"))}
        _post_event("env", env)
        _post_event("reward", {"value": 1.0})


class AsyncRewardAgent:
    """An `async def run()` agent: the bootstrap must await it."""

    async def run(self) -> None:
        await asyncio.sleep(0)
        key = os.environ["AGL_KEY"]
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"} if key else {}) as client:
            resp = await client.post(
                os.environ["AGL_EVENT_URL"], json={"event_type": "reward", "data": {"value": 0.25}}
            )
            resp.raise_for_status()


class CrashAgent:
    """Raises: the bootstrap prints the traceback and exits 1."""

    def run(self) -> None:
        print("about to crash", file=sys.stderr)
        raise RuntimeError("agent crashed on purpose")


class ExitCodeAgent:
    """Exits with code 3 after a line on stderr."""

    def run(self) -> None:
        print("bad configuration: giving up", file=sys.stderr, flush=True)
        sys.exit(3)


class HangAgent:
    """Starts a 'tool server' child, reports both pids, then hangs until killed."""

    def run(self) -> None:
        tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        _post_event("pids", {"agent": os.getpid(), "tool": tool.pid})
        time.sleep(120)


class PidFileHangAgent:
    """Starts a 'tool server' child, writes both pids as files under `T_PID_DIR`, then hangs
    until killed (the SIGTERM test of `agl-lab train` checks that none is left alive)."""

    def run(self) -> None:
        from pathlib import Path

        tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        for pid in (os.getpid(), tool.pid):
            (Path(os.environ["T_PID_DIR"]) / str(pid)).touch()
        time.sleep(300)


class DaemonAgent:
    """Starts a daemon as a tool server daemonises (fork, `setsid`, fork again: a `sleep` in a
    session of its own, re-parented to init), reports both pids, then hangs if `T_HANG` is set."""

    def run(self) -> None:
        read_end, write_end = os.pipe()
        if os.fork() == 0:  # the first child: a new session, the daemon forked from it, then gone
            os.setsid()
            daemon = os.fork()
            if daemon == 0:
                os.execvp("sleep", ["sleep", "300"])
            os.write(write_end, str(daemon).encode())
            os._exit(0)
        os.close(write_end)
        daemon = int(os.read(read_end, 32))
        os.wait()  # the first child exits at once: the daemon's parent is now init
        _post_event("pids", {"agent": os.getpid(), "daemon": daemon})
        if os.environ.get("T_HANG"):
            time.sleep(300)


class SleepAgent:
    """Sleeps `T_SLEEP` seconds (default 0.3), then posts reward 1.0."""

    def run(self) -> None:
        time.sleep(float(os.environ.get("T_SLEEP", "0.3")))
        _post_event("reward", {"value": 1.0})


# ---------------------------------------------------------------------------------------------
# A multi-turn agent written with the openai SDK (two chat calls with an observation between)
# ---------------------------------------------------------------------------------------------


def multi_turn_episode(client, question: str) -> float:
    """Ask, append the reply and an observation, ask again; reward 1.0 if the second reply
    came back (the fake upstream names the turn it answers)."""
    messages = [
        {"role": "system", "content": "You are a careful calculator agent."},
        {"role": "user", "content": question},
    ]
    first = client.chat.completions.create(model="auto", messages=messages, max_tokens=16)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": OBSERVATION},
    ]
    second = client.chat.completions.create(model="auto", messages=messages, max_tokens=16)
    return 1.0 if second.choices[0].message.content.startswith("reply-4") else 0.0


def multi_turn_agent(task: dict, ctx) -> float:
    """Callable form for `Runner(agent=multi_turn_agent)`."""
    return multi_turn_episode(ctx.openai_client(max_retries=2), task["question"])


class MultiTurnOpenAIAgent:
    """AGL class form: the same episode through `AGL_OPENAI_BASE_URL`, reward POSTed."""

    def run(self) -> None:
        import openai

        client = openai.OpenAI(
            base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"] or "EMPTY", max_retries=2
        )
        _post_event("reward", {"value": multi_turn_episode(client, os.environ["T_QUESTION"])})


class CalcXAgent:
    """calc_x's shape (AGL example): the task through env_map (`QUESTION`, `RESULT`), two chat
    calls with a tool observation between, reward POSTed. The tiny model cannot do arithmetic,
    so the score is a stand-in with variance: 1.0 for the right result, else the parity of the
    reply's length."""

    def run(self) -> None:
        import openai

        client = openai.OpenAI(
            base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"] or "EMPTY", max_retries=2
        )
        messages = [{"role": "user", "content": os.environ["QUESTION"]}]
        first = client.chat.completions.create(model="auto", messages=messages, max_tokens=6)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "calculator: ok"},
        ]
        answer = (
            client.chat.completions.create(model="auto", messages=messages, max_tokens=6).choices[0].message.content
        )
        reward = 1.0 if os.environ["RESULT"] in answer else float(len(answer) % 2)
        _post_event("reward", {"value": reward})


_started, _lock = 0, threading.Lock()


def killed_lookup_agent(task: dict, ctx) -> float | None:
    """The lookup task's agent; the process dies by SIGKILL (kill -9) as rollout number
    `$AGL_TEST_KILL_AT_ROLLOUT` of this process starts (unset: never)."""
    from agl_lab.tasks.lookup import lookup_agent

    global _started
    with _lock:
        _started += 1
        n = _started
    kill_at = int(os.environ.get("AGL_TEST_KILL_AT_ROLLOUT", "0"))
    if kill_at and n >= kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
        threading.Event().wait()  # SIGKILL is not delivered synchronously everywhere
    return lookup_agent(task, ctx)


def remote_agent(task: dict, ctx) -> float | None:
    """The `agl-lab runner` tests' agent: reports which process ran which attempt (a `ran`
    event), holds its rollout until the runner cancels it when the task says `hold` (and the
    runner's environment does not set AGL_TEST_NO_HOLD), then returns reward 1.0."""
    ctx.emit("ran", {"pid": os.getpid(), "attempt": ctx.attempt_id})
    if task.get("hold") and not os.environ.get("AGL_TEST_NO_HOLD"):
        ctx.cancelled.wait(120)
        return None
    return 1.0


# ---------------------------------------------------------------------------------------------
# Agents of the shape of AGL v1's examples/gsm8k/gsm8k_agent.py (written here, not copied): the
# task from env_map (QUESTION, ANSWER), the endpoint and key from AGL_OPENAI_BASE_URL / AGL_KEY,
# the reward POSTed to AGL_EVENT_URL. They also POST what they saw, for the test to assert on.
# ---------------------------------------------------------------------------------------------

GSM_PROMPT = "Solve the problem and give the final answer after '### ANSWER:'.\n\n{question}"


def gsm_final_answer(text: str) -> str:
    """The final answer: after the last '### ANSWER:', else after '####', else the last number."""
    import re

    text = (text or "").replace(",", "")
    for marker in ("### ANSWER:", "####"):
        if marker in text:
            return text.rsplit(marker, 1)[1].strip().strip("#").strip()
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return numbers[-1] if numbers else ""


def _gsm_client():
    import openai

    return openai.AsyncOpenAI(
        base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"] or "EMPTY", max_retries=6
    )


class GsmChatAgent:
    """gsm8k's ChatAgent shape: one async chat call on the question, reward 1.0 for the right answer."""

    async def run(self) -> None:
        question, answer = os.environ["QUESTION"], os.environ["ANSWER"]
        resp = await _gsm_client().chat.completions.create(
            model="auto",
            messages=[{"role": "user", "content": GSM_PROMPT.format(question=question)}],
            temperature=1.0,
            max_tokens=16,
        )
        text = resp.choices[0].message.content or ""
        reward = 1.0 if gsm_final_answer(text) == gsm_final_answer(answer) else 0.0
        _post_event("agent_saw", {"question": question, "answer": answer, "reply": text})
        _post_event("reward", {"value": reward})


class GsmCompletionAgent:
    """gsm8k's CompletionAgent shape: the prompt tokenized here with the HF tokenizer at
    `GSM8K_MODEL` (an env_map literal), sent as token ids to /v1/completions, the reply read
    from `choices[0].token_ids` and decoded here."""

    async def run(self) -> None:
        from transformers import AutoTokenizer

        question, answer = os.environ["QUESTION"], os.environ["ANSWER"]
        tokenizer = AutoTokenizer.from_pretrained(os.environ["GSM8K_MODEL"])
        prompt_ids = tokenizer.encode(GSM_PROMPT.format(question=question), add_special_tokens=False)
        resp = await _gsm_client().completions.create(model="auto", prompt=prompt_ids, temperature=1.0, max_tokens=16)
        choice = resp.choices[0]
        token_ids = getattr(choice, "token_ids", None)
        if token_ids is None:
            token_ids = (choice.model_extra or {}).get("token_ids")
        if token_ids is None:
            raise RuntimeError("OpenAI response choice did not include token_ids")
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        reward = 1.0 if gsm_final_answer(text) == gsm_final_answer(answer) else 0.0
        _post_event(
            "agent_saw", {"question": question, "answer": answer, "reply": text, "n_prompt_ids": len(prompt_ids)}
        )
        _post_event("reward", {"value": reward})


def ray_hold_agent(task: dict, ctx) -> float:
    """The `--ray` runner tests' agent: holds its rollout while the file `task["hold_file"]`
    (when given) does not exist yet, and, given `task["meet_dir"]`, leaves a file there and waits
    until `task["meet_count"]` agents have (so that many ran at the same time); each wait at most
    300 s. Returns reward 1.0."""
    end = time.monotonic() + 300
    path = task.get("hold_file")
    while path and not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.2)
    meet = task.get("meet_dir")
    if meet:
        Path(meet, uuid.uuid4().hex).touch()
        while len(os.listdir(meet)) < task["meet_count"] and time.monotonic() < end:
            time.sleep(0.1)
    return 1.0
