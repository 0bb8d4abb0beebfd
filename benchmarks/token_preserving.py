"""Benchmark the token-preserving gateway mode on the built-in multi-turn task (`lookup`).

The same tasks run through two gateways on one engine (the tiny model on CPU): the normal
path (the engine re-renders and re-tokenises the conversation on every call) and the
token-preserving mode (earlier turns keep their sampled ids). Per mode, the batch builder
merges each rollout's calls at trajectory level and the table reports:

    rows / rollout          training rows per rollout (1.0 = every rollout merged)
    merged into one row     share of rollouts that built exactly one row
    merge breaks / step     calls whose prompt did not extend the previous context
    forward tokens / step   attended tokens of the batch (what the update's forward pass reads)
    calls preserved         share of calls sent as token ids by the mode

    python benchmarks/token_preserving.py [--rollouts 32] [--steps 2] [--warm-start-steps 0]
    python benchmarks/token_preserving.py --preset smollm2-135m --task calc --rollouts 16 --steps 1
    python benchmarks/token_preserving.py --preset smollm2-135m --task lookup --agents all --rollouts 16 --steps 1

By default the model is freshly initialised: its replies are byte soup, which is where BPE
drift is most frequent; `--warm-start-steps 150` fits the task format first (cached).
"""

from __future__ import annotations

import argparse
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pandas as pd

from agl_lab.batch import build_batch
from agl_lab.engines.serving.openai_server import OpenAIServer
from agl_lab.engines.tiny import DEFAULT_MODEL_NAME, load_model_and_tokenizer
from agl_lab.protocol import Model, RolloutCreate
from agl_lab.records import CompletedRollout, events_to_completed_rollout, triplet_events
from agl_lab.results import BatchResult
from agl_lab.server.embedded import EmbeddedServer
from agl_lab.server.gateway import proxy_base_url
from agl_lab.tasks import get_task


def run_step(server: EmbeddedServer, agent: Any, tasks: list[dict], step: int) -> list[CompletedRollout]:
    """All tasks concurrently through `server`'s gateway → CompletedRollouts."""
    creates = [RolloutCreate(rollout_id=uuid.uuid4().hex, input=t) for t in tasks]
    rollouts = server.store.create_rollouts(creates)

    def play(rollout: Any) -> Any:
        ctx = SimpleNamespace(base_url=proxy_base_url(server.url, rollout.rollout_id), api_key="EMPTY")
        return agent(rollout.input, ctx)

    with ThreadPoolExecutor(len(rollouts)) as pool:
        list(pool.map(play, rollouts))
    completed = []
    for i, rollout in enumerate(rollouts):
        events = server.store.events(rollout.rollout_id)
        completed.append(
            events_to_completed_rollout(
                rollout,
                [e.model_dump() for e in events],
                [e.model_dump() for e in triplet_events(events)],
                data_id=rollout.input["task_id"],
                step=step,
                sample_idx=i,
            )
        )
    return completed


def step_stats(completed: list[CompletedRollout], tokenizer: Any) -> dict[str, float]:
    result = BatchResult(
        build_batch(
            completed,
            "trajectory",
            max_prompt_length=512,
            max_response_length=1024,
            pad_token_id=tokenizer.pad_token_id,
            tokenizer=tokenizer,
        )
    )
    rows = result.rows.groupby("rollout_id").size()
    notes = [
        e["data"].get("token_preserving") for r in completed for e in r.events if e["event_type"] == "model_request"
    ]
    return {
        "rollouts": len(completed),
        "calls": len(notes),
        "rows": len(result.data),
        "one_row": int((rows == 1).sum()),
        "breaks": len(result.breaks),
        "retokenization": int((result.breaks["kind"] == "retokenization").sum()) if len(result.breaks) else 0,
        "kinds": result.breaks["kind"].value_counts().to_dict() if len(result.breaks) else {},
        "tokens": int(result.data.batch["attention_mask"].sum()),
        "preserved": sum(bool(n and n.get("used")) for n in notes),
    }


def run_mode(
    engine: OpenAIServer,
    tokenizer: Any,
    on: bool,
    n: int,
    steps: int,
    task: str = "lookup",
    model_name: str = DEFAULT_MODEL_NAME,
    agent: str | None = None,
) -> dict[str, Any]:
    """`steps` steps of `n` rollouts of `agent` (a name in the task's `agents`, None: its default
    agent) through a fresh gateway on `engine`, token-preserving `on` or off → one table row."""
    spec = get_task(task)
    play = spec.agent if agent is None else spec.agents[agent]
    server = EmbeddedServer(default_proxy={"model_name": model_name}, token_preserving=on)
    try:
        server.store.upsert_models([Model(model=model_name, endpoint=engine.base_url)])
        if on:
            server.set_tokenizer(model_name, tokenizer)
        start = time.perf_counter()
        stats = [step_stats(run_step(server, play, spec.train_tasks(n, s), s), tokenizer) for s in range(steps)]
        seconds = time.perf_counter() - start
    finally:
        server.stop()
    kinds: dict[str, int] = {}
    for st in stats:
        for kind, count in st.pop("kinds").items():
            kinds[kind] = kinds.get(kind, 0) + count
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    return {
        "agent": f"{task}/{agent or 'default'}",
        "mode": "token_preserving" if on else "off (re-tokenise)",
        "rollouts": total["rollouts"],
        "calls": total["calls"],
        "rows / rollout": round(total["rows"] / total["rollouts"], 3),
        "merged into one row": f"{total['one_row'] / total['rollouts']:.1%}",
        "merge breaks / step": round(total["breaks"] / steps, 1),
        "  of which retokenization": round(total["retokenization"] / steps, 1),
        "break kinds (all steps)": ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "-",
        "breaks / call after the first": f"{total['breaks'] / max(1, total['calls'] - total['rollouts']):.1%}",
        "forward tokens / step": round(total["tokens"] / steps),
        "calls preserved": f"{total['preserved'] / total['calls']:.1%}",
        "wall s": round(seconds, 1),
    }


def compare(
    engine: OpenAIServer,
    tokenizer: Any,
    agents: list[tuple[str, str | None]],
    n: int,
    steps: int = 1,
    model_name: str = DEFAULT_MODEL_NAME,
) -> pd.DataFrame:
    """Each (task, agent) with the token-preserving gateway off, then on: one row per (agent, mode)."""
    return pd.DataFrame(
        [
            run_mode(engine, tokenizer, on, n, steps, task, model_name, agent)
            for task, agent in agents
            for on in (False, True)
        ]
    )


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warm-start-steps", type=int, default=0)
    parser.add_argument("--task", default="lookup", help="a built-in task (lookup | calc)")
    parser.add_argument("--preset", default=None, help="a model preset (e.g. smollm2-135m) instead of the tiny model")
    parser.add_argument(
        "--agents",
        default=None,
        help="comma-separated agents of the task's `agents` (e.g. append_only,history_editing,"
        "reasoning_dropping for lookup; `all` for every one); default: the task's agent",
    )
    args = parser.parse_args(argv)

    model_path = None
    if args.preset:
        from agl_lab.models import preset_dir

        model_path = preset_dir(args.preset)
    model, tokenizer = load_model_and_tokenizer(model_path, device="cpu")
    name = args.preset or DEFAULT_MODEL_NAME
    if args.warm_start_steps:
        from agl_lab.engines.warmstart import warm_start
        from agl_lab.tasks import get_task

        warm_start(model, tokenizer, get_task(args.task), steps=args.warm_start_steps, seed=0)
    agents: list[str | None] = [None]
    if args.agents:
        known = get_task(args.task).agents
        agents = list(known) if args.agents == "all" else args.agents.split(",")
        unknown = [a for a in agents if a not in known]
        if unknown:
            parser.error(f"--agents: {unknown} are not agents of task {args.task!r}; known: {sorted(known)}")
    engine = OpenAIServer(model, tokenizer, model_name=name, max_model_len=2048 if model_path else 1024)
    try:
        table = compare(engine, tokenizer, [(args.task, a) for a in agents], args.rollouts, args.steps, name)
    finally:
        engine.stop()
    print(
        f"{args.task} task, {name} (warm start {args.warm_start_steps} steps), "
        f"{args.rollouts} rollouts x {args.steps} steps, trajectory level"
    )
    print(table.set_index(["agent", "mode"]).T.to_string())
    return table


if __name__ == "__main__":
    main()
