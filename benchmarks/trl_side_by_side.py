r"""agl_lab against TRL 1.16's GRPOTrainer on the same SmolLM2 `calc` steps (#51 item 6: keep the lead measured).

Both cases train the recipe of docs/real-model.md (`configs/cpu_smollm2_learn.yaml`) for `--steps`
steps, one after the other, each in a fresh interpreter, 2 torch threads each:

    agl_lab   the config as recorded (LoRA, bypass mode, zero-advantage skip, shared prefix,
              token-preserving gateway), the calc agent's OpenAI tool loop, validation off
    trl       TRL 1.16 `GRPOTrainer` in its own venv (`.venv-trl`, built here on first use: TRL is
              never a dependency of agl_lab), generating with transformers' `generate`, its
              multi-turn tool loop running the same `calculator`

What is the same: the float32 weights (the `smollm2-135m` preset's converted directory, nothing
from a model hub), the tasks (`calc.train_tasks(256, seed)`, step k takes tasks 4k..4k+3 on both
sides), the prompt ids (the TRL child renders every prompt through TRL's own path and refuses to
run unless the ids equal the template's rendering with calc's `TOOLS`), the tool, the reward (0.8
right number + 0.2 calculator called; 0 without an answer), group 4, batch 4 prompts, one
optimiser step a step, micro-batch 4 (2 in the run docs/benchmarks.md records), LoRA r16/α32
all-linear (dropout 0), AdamW lr 5e-5 (β 0.9/0.999, weight decay 0.01, constant), clip 0.2/0.28, no
KL, temperature 1, at most 4 calls (TRL: `max_tool_calling_iterations=3`), 256 completion tokens a
rollout.

What differs (TRL's shape, the closest it supports): TRL has no per-call stop or cap — a call ends
at `<|im_end|>` or the rollout's 256-token budget, where agl_lab's calls stop at `</tool_call>` and
are capped at 48 (16 for the answer) tokens; TRL generates every turn as one padded batch of the
rollouts still calling, where agl_lab's engine batches calls continuously as they arrive; TRL's
loss is its default (`dapo`: token sum over the batch's tokens), agl_lab's is verl's as configured.

Columns (per case; the median over steps 2..N when N ≥ 2, else step 1 — the header says which):

    step_s     wall seconds of the step (rollouts, reward, update)
    cpu_s      CPU seconds the case's process spent in the step (every thread: engine, gateway,
               agents and update for agl_lab): on a shared machine the figure the load moves least
    gen_s      the rollout phase (agl_lab `timing_s/gen`; TRL `_generate_and_score_completions`)
    gen_tok/s  tokens the model generated in the phase (tool results not counted) / gen_s
    upd_s      step_s − gen_s
    upd_tok/s  the step's batch tokens (prompt + completion with tool results, every rollout) / upd_s
    rss_gb     the process's peak RSS after the last step
    reward     mean reward over all steps' rollouts

    nice -n 10 python benchmarks/trl_side_by_side.py [--steps 2] [--cases agl_lab,trl] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/cpu_smollm2_learn.yaml"
VENV = ROOT / ".venv-trl"
# TRL with the CPU torch pin, the transformers/peft of agl_lab's own venv (they install together) and
# jmespath (TRL parses tool calls with it on transformers < 5.13)
TRL_PINS = ("torch==2.13.0", "trl==1.16.0", "transformers==5.10.4", "peft==0.21.2", "jmespath==1.1.0")
CASES = ("agl_lab", "trl")
THREADS = 2
BATCH, GROUP, MICRO, MAX_CALLS, MAX_COMPLETION = 4, 4, 4, 4, 256  # MICRO: the config's ppo_micro_batch_size_per_gpu
COLUMNS = ("step_s", "cpu_s", "gen_s", "gen_tok/s", "upd_s", "upd_tok/s", "rss_gb", "reward")


# --- the parent: venv, cases, table ------------------------------------------------------------


def venv_commands(venv: Path = VENV, python: str = "python3.11") -> list[list[str]]:
    """The commands that build the TRL venv (run only when `venv`'s python cannot import trl)."""
    return [[python, "-m", "venv", str(venv)], [str(venv / "bin" / "python"), "-m", "pip", "install", *TRL_PINS]]


def ensure_venv(venv: Path = VENV) -> Path:
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import trl, peft"], capture_output=True).returncode == 0:
        return py
    for cmd in venv_commands(venv):
        print("# " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return py


def case_command(case: str, model_dir: str, steps: int, seed: int, python: str | None = None) -> list[str]:
    """The fresh interpreter of one case: agl_lab's own python, or the TRL venv's."""
    py = python or (sys.executable if case == "agl_lab" else str(VENV / "bin" / "python"))
    return [
        py,
        str(Path(__file__).resolve()),
        "--child",
        case,
        "--model-dir",
        model_dir,
        f"--steps={steps}",
        f"--seed={seed}",
    ]


def run_case(name: str, cmd: list[str]) -> list[dict]:
    """One case's per-step rows, printed as they arrive (a TRL step takes minutes: a run cut short keeps them)."""
    import tempfile

    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    rows, tail = [], []
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        for line in child.stdout:
            tail = [*tail[-20:], line]
            if line.startswith("NOTE "):
                print("#   " + line[5:].rstrip(), flush=True)
            elif line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                print(
                    f"#   {name} step {len(rows)}: " + json.dumps({k: round(v, 3) for k, v in rows[-1].items()}),
                    flush=True,
                )
        if child.wait() != 0:
            err.seek(0)
            raise SystemExit(f"case {name} failed:\n{''.join(tail)}\n{err.read()[-3000:]}")
    return rows


def summary(rows: list[dict]) -> dict[str, float]:
    """Medians over steps 2..N (step 1 alone when N = 1); peak RSS and the mean reward over all steps."""
    tail = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in tail) for k in ("step_s", "cpu_s", "gen_s")}
    med["gen_tok/s"] = statistics.median(r["gen_tokens"] / r["gen_s"] for r in tail)
    med["upd_s"] = statistics.median(r["step_s"] - r["gen_s"] for r in tail)
    med["upd_tok/s"] = statistics.median(r["batch_tokens"] / (r["step_s"] - r["gen_s"]) for r in tail)
    med["rss_gb"] = max(r["rss_gb"] for r in rows)
    med["reward"] = statistics.mean(r["reward"] for r in rows)
    return med


def table(summaries: dict[str, dict[str, float]], steps: int) -> list[str]:
    """The side-by-side table (markdown), with a ratio line when both cases ran."""
    which = "median of steps 2.." + str(steps) if steps >= 2 else "step 1 (warm-up included)"
    lines = [f"| case ({which}) | " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    lines += [f"| {name} | " + " | ".join(f"{s[c]:.2f}" for c in COLUMNS) + " |" for name, s in summaries.items()]
    if set(CASES) <= set(summaries):
        a, t = summaries["agl_lab"], summaries["trl"]
        ratios = [t[c] / a[c] if c.endswith("_s") or c == "rss_gb" else a[c] / t[c] for c in COLUMNS[:-1]]
        lines.append("| agl_lab's lead (×) | " + " | ".join(f"{r:.1f}" for r in ratios) + " | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    p.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be ≥ 1, got {args.steps}")
    names = args.cases.split(",")
    if unknown := [n for n in names if n not in CASES]:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    if args.child:
        (agl_child if args.child == "agl_lab" else trl_child)(args.model_dir, args.steps, args.seed)
        return 0
    from agl_lab.models import smollm2

    model_dir = str(smollm2())
    trl_python = str(ensure_venv()) if "trl" in names else None
    print(f"# {CONFIG}, {args.steps} steps a case, seed {args.seed}, {THREADS} threads; load {os.getloadavg()}")
    summaries = {}
    for name in names:
        cmd = case_command(name, model_dir, args.steps, args.seed, trl_python if name == "trl" else None)
        summaries[name] = summary(run_case(name, cmd))
    print(f"# load after: {os.getloadavg()}")
    print("\n".join(table(summaries, args.steps)))
    return 0


# --- the children: one per case, each prints a ROW line per step ---------------------------------


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _calc_module():
    """agl_lab/tasks/calc.py by path: the TRL venv has no agl_lab (calc imports only the stdlib)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("calc", ROOT / "agl_lab" / "tasks" / "calc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def agl_child(model_dir: str, steps: int, seed: int) -> None:
    import tempfile

    from agl_lab.trainer import Trainer

    tasks = _calc_module().train_tasks(256, seed)
    overrides = [
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"agl_lab.torch_threads={THREADS}",
        f"agl_lab.seed={seed}",
    ]
    with (
        tempfile.TemporaryDirectory() as run_dir,
        Trainer.from_config(CONFIG, overrides=overrides, run_dir=run_dir, console=False) as trainer,
    ):
        for step in range(steps):
            t0, c0 = time.time(), time.process_time()
            ro = trainer.rollout(tasks[BATCH * step : BATCH * (step + 1)])
            b = trainer.build_batch(ro)
            trainer.update(b)
            rewards = [r.final_reward for r in ro.rollouts]
            row = {
                "step_s": time.time() - t0,
                "cpu_s": time.process_time() - c0,
                "gen_s": ro.metrics["timing_s/gen"],
                "gen_tokens": sum(len(t.response_ids) for r in ro.rollouts for t in (r.triplets or [])),
                "batch_tokens": int(b.data.batch["attention_mask"].sum()),
                "rss_gb": _peak_rss_gb(),
                "reward": statistics.mean(0.0 if x is None else float(x) for x in rewards),
            }
            print("ROW " + json.dumps(row), flush=True)


def _trl_tokenizer(model_dir: str, calc):
    """The preset's tokenizer, for TRL: its tool list rendered from `calc_tools` (calc's own schemas,
    passed as a template variable) instead of the schema transformers derives from the Python
    callable, so the prompt ids are the ones agl_lab's server renders; and the Hermes
    `<tool_call>{json}</tool_call>` response parser TRL ships for Qwen3 (SmolLM2's template is not one
    TRL recognises; the block format is the same)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_schema

    tok = AutoTokenizer.from_pretrained(model_dir)
    loop = "{%- for tool in tools %}"
    if tok.chat_template.count(loop) != 1:
        raise SystemExit(f"{model_dir}: the chat template has no single {loop!r}: has the preset's template changed?")
    original = tok.chat_template
    tok.chat_template = original.replace(loop, "{%- for tool in calc_tools %}")
    tok.response_schema = qwen3_schema
    return tok, original


def _check_prompt_ids(tok, original: str, dataset, tasks: list[dict], calculator, calc) -> None:
    """Every prompt as TRL renders it (its batched call) must equal the template's rendering with calc.TOOLS."""
    theirs = tok.apply_chat_template(
        conversation=list(dataset["prompt"]),
        tools=[calculator],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        calc_tools=calc.TOOLS,
    )["input_ids"]
    for i, task in enumerate(tasks):
        ours = tok.apply_chat_template(
            calc.first_messages(task),
            tools=calc.TOOLS,
            chat_template=original,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        if list(theirs[i]) != list(ours):
            raise SystemExit(
                f"prompt {i} ({task['task_id']}): TRL's ids differ from the template's ({len(theirs[i])} vs {len(ours)})"
            )
    print(
        f"NOTE trl: {len(theirs)} prompts render to the same ids as agl_lab's ({len(theirs[0])} tokens the first)",
        flush=True,
    )


def _calc_reward(calc):
    """calc_agent's reward on TRL's conversational completion: the last assistant message is the
    answer when it calls no tool; 0.2 × a calculator call + 0.8 × the right number."""
    rewards: list[float] = []

    def calc_reward(prompts, completions, **columns) -> list[float]:
        out = []
        for i, messages in enumerate(completions):
            last = messages[-1] if messages else {}
            answer = (
                last.get("content") or "" if last.get("role") == "assistant" and not last.get("tool_calls") else None
            )
            called = any(
                (call.get("function") or {}).get("name") == "calculator"
                for m in messages
                if m.get("role") == "assistant"
                for call in m.get("tool_calls") or []
            )
            task = {"value": columns["value"][i]}
            out.append(
                0.0 if answer is None else calc.TOOL_WEIGHT * called + calc.ANSWER_WEIGHT * calc.reward(task, answer)
            )
        rewards.extend(out)
        return out

    return calc_reward, rewards


def trl_child(model_dir: str, steps: int, seed: int) -> None:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(THREADS)
    calc = _calc_module()

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as 12 * 7

        Args:
            expression: the expression, `a op b`
        """
        return calc.calculator(json.dumps({"expression": expression}))

    tasks = calc.train_tasks(256, seed)[: BATCH * steps]
    dataset = datasets.Dataset.from_list(
        [{"prompt": calc.first_messages(t), "value": t["value"], "task_id": t["task_id"]} for t in tasks]
    )
    tok, original = _trl_tokenizer(model_dir, calc)
    _check_prompt_ids(tok, original, dataset, tasks, calculator, calc)
    reward_fn, rewards = _calc_reward(calc)
    args = GRPOConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"trl-side-by-side-{os.getpid()}"),
        max_steps=steps,
        seed=seed,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=BATCH * GROUP // MICRO,
        num_generations=GROUP,
        shuffle_dataset=False,
        num_iterations=1,
        learning_rate=5e-5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        temperature=1.0,
        top_p=1.0,
        max_completion_length=MAX_COMPLETION,
        max_tool_calling_iterations=MAX_CALLS - 1,
        chat_template_kwargs={"calc_tools": calc.TOOLS},
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        peft_config=lora,
        tools=[calculator],
    )
    phase: dict[str, float] = {}
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):  # the rollout phase: generation with the tool loop, then the reward
        t0 = time.time()
        out = generate(*a, **k)
        generated = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        phase.update(
            gen_s=time.time() - t0,
            gen_tokens=int(generated.sum()),
            batch_tokens=int(out["prompt_mask"].sum() + out["completion_mask"].sum()),
        )
        return out

    trainer._generate_and_score_completions = timed_generate

    class StepRows(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            if "t0" not in phase:
                phase.update(t0=time.time(), c0=time.process_time())

        def on_step_end(self, *_a, **_k):
            n = BATCH * GROUP
            row = {
                "step_s": time.time() - phase.pop("t0"),
                "cpu_s": time.process_time() - phase.pop("c0"),
                "gen_s": phase["gen_s"],
                "gen_tokens": phase["gen_tokens"],
                "batch_tokens": phase["batch_tokens"],
                "rss_gb": _peak_rss_gb(),
                "reward": statistics.mean(rewards[-n:]),
            }
            print("ROW " + json.dumps(row), flush=True)

    trainer.add_callback(StepRows())
    trainer.train()


if __name__ == "__main__":
    sys.exit(main())
