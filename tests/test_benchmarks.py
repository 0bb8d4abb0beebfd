"""The benchmark scripts still run end to end and print every row of their tables.

They time nothing here (timing stays out of tests): the smallest settings, then the table's
rows and columns are checked, so a script broken by a refactor fails in CI rather than in
the next benchmarking session.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float = 240) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _rows_by_first_cell(out: str) -> dict[str, list[str]]:
    """Every ` | `-separated line of `out` (header included): {first cell: cells}."""
    return {
        line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in out.splitlines() if " | " in line
    }


def _rows(out: str, first_column: str) -> dict[str, list[str]]:
    """The table whose header starts with `first_column`: {first cell: cells} per data row."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\s*{re.escape(first_column)}\s*\|", line))
    rows = {}
    for line in lines[start + 2 :]:
        if "|" not in line:
            break
        cells = [c.strip() for c in line.split("|")]
        rows[f"{cells[0]}@{cells[1]}"] = cells
    return rows


@pytest.mark.slow
def test_gateway_benchmark_prints_every_server_and_the_store_table():
    # two rounds: the servers take turns and each keeps its client session across them
    out = _run(
        "benchmarks/gateway.py",
        "--agents",
        "1",
        "--rounds",
        "2",
        "--pairs",
        "4",
        "--seconds",
        "0.3",
        "--events",
        "50",
        "--no-agl",
    )
    gateway = _rows(out, "server")
    assert set(gateway) == {f"{name}@1" for name in ("memory", "sqlite", "floor", "floor+json", "uvicorn+json")}
    for cells in gateway.values():
        assert len(cells) == 18 and all(cells), cells
        assert float(cells[8].replace(",", "")) > 0  # calls/s: the throughput phase made calls
    # without agentlightning the AGL columns come from issue #17's figures, and say so
    assert "issue #17's figures (agentlightning not importable)" in out
    assert gateway["memory@1"][15] != "n/a" and gateway["memory@1"][17] == "n/a"  # no ceiling figure at 1 agent
    store = _rows(out, "store")
    assert set(store) == {"memory@50", "sqlite@50"}


def _batch_rows(out: str) -> dict[tuple[str, str], list[str]]:
    """batch.py's rows: {(level, AGL env tag): cells}."""
    return {
        (cells[0], cells[-1]): cells
        for cells in map(str.split, out.splitlines())
        if cells[:1] in (["trajectory"], ["transition"])
    }


@pytest.mark.slow
def test_batch_benchmark_prints_both_levels():
    out = _run("benchmarks/batch.py", "--repeat", "1", "--no-agl")
    rows = _batch_rows(out)
    assert set(rows) == {("trajectory", "issue"), ("transition", "issue")}
    assert rows["trajectory", "issue"][1] == "512" and rows["transition", "issue"][1] == "4096"  # per rollout / call
    assert rows["trajectory", "issue"][3:5] == ["433", "(issue)"]  # AGL's figure from issue #17, labelled
    assert "nan" not in out
    assert "issue #17's figures (agentlightning not importable)" in out or "issue #17's figures (--no-agl)" in out


def test_batch_peer_rollout_file_round_trips(tmp_path):
    # what batch.py hands AGL's own environment is exactly the rollouts it times itself on
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import agl_peer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    prompt, response = [5, 6, 7], [8, 9]
    records = [
        ("r0", "d0", 0, 0, 1.0, [(prompt, response, [-0.5, -0.25]), (prompt + response + [10], [11], [-0.125])]),
        ("r1", "d0", 0, 1, 0.0, [([1], [2, 3], [-1.0, -2.0])]),
    ]
    agl_peer.save_rollouts(str(tmp_path / "r.npz"), records)
    assert agl_peer.load_rollouts(str(tmp_path / "r.npz")) == records
    with pytest.raises(ValueError, match="not a prefix"):  # only append-only rollouts travel this way
        agl_peer.save_rollouts(
            str(tmp_path / "bad.npz"), [("r2", "d1", 0, 0, 0.0, [([1], [2], [0.0]), ([3], [4], [0.0])])]
        )


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("AGL_PYTHON"),
    reason="AGL_PYTHON unset: no Python of AGL's own environment (recipe in benchmarks/batch.py)",
)
def test_batch_benchmark_times_agl_in_its_own_environment():
    out = _run("benchmarks/batch.py", "--repeat", "1", "--no-agl", "--agl-python", os.environ["AGL_PYTHON"])
    rows = _batch_rows(out)
    assert set(rows) == {("trajectory", "own"), ("transition", "own")}
    for cells in rows.values():
        assert len(cells) == 12 and cells[8] == "yes", cells  # measured, bit-identical to agl_lab's batch
    label = next(line for line in out.splitlines() if line.startswith("AGL env own: "))
    assert "AGL in its own env (verl " in label and "numpy " in label and os.environ["AGL_PYTHON"] in label
    assert "issue #17" not in out and "nan" not in out


@pytest.mark.slow
def test_claims_benchmark_prints_both_paths_for_every_backend():
    out = _run("benchmarks/claims.py", "--rollouts", "20", "--runners", "2", "--no-agl")
    rows = _rows(out, "path")
    assert set(rows) == {"claim@2", "list+PATCH@2"}
    groups = 3 if shutil.which("initdb") else 2  # memory, SQLite and (a throwaway) PostgreSQL
    for cells in rows.values():
        assert len(cells) == 2 + 3 * groups and all(cells), cells
        assert all(float(cells[2 + 3 * g]) > 0 for g in range(groups))  # rollouts/s measured on each backend
    assert all(rows["claim@2"][3 + 3 * g] == "0.00" for g in range(groups))  # the claim route never conflicts
    assert "AGL columns absent: --no-agl" in out


def test_runner_start_benchmark_prints_every_case_and_no_server_stack_in_a_runner():
    out = _run("benchmarks/runner_start.py", "--repeats", "1", "--load", "0")
    rows = _rows(out, "case")
    cases = ("python -c pass", "runner --help", "runner to polling", "runner to 1 done", "server stack+numpy")
    assert set(rows) == {f"{case}@0" for case in cases}
    for cells in rows.values():
        assert len(cells) == 7 and all(cells) and float(cells[3]) > 0, cells
    assert all(rows[f"{case}@0"][6] == "0" for case in cases[:4])  # a runner loads neither
    assert int(rows["server stack+numpy@0"][6]) > 0  # the column counts what it names


def test_replay_start_benchmark_prints_every_case_and_ray_only_where_verl_is_imported():
    out = _run("benchmarks/replay_start.py", "--repeats", "1", "--load", "0", timeout=600)
    rows = _rows(out, "case")
    assert set(rows) == {"python -c pass@0", "replay@0", "replay + verl imports@0"}
    for cells in rows.values():
        assert len(cells) == 8 and all(cells) and float(cells[3]) > 0, cells
    assert rows["replay@0"][7] == "no" and rows["replay + verl imports@0"][7] == "yes"


def test_step_cost_work_comparison_prints_every_variant_and_its_exactness():
    """`step_cost.py --compare work` on the tiny model: the four variants, the zero-skip one
    bit-equal to padded, the shared-prefix ones sending fewer tokens through the body."""
    out = _run(
        "benchmarks/step_cost.py",
        "--preset=tiny",
        "--compare=work",
        "--repeat=1",
        "--rollouts=8",
        "--micro=2",
        "--max-model-len=1024",
        "--max-prompt-length=400",
        "--max-response-length=200",
        timeout=600,
    )
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["update", "s"])
    assert "body tokens" in lines[start] and "grad bit-equal" in lines[start]
    rows = {}
    for name in ("padded", "+ zero-skip", "+ shared prefix", "both"):
        line = next(line for line in lines[start:] if line.startswith(name + " "))
        rows[name] = line[len(name) :].split()  # update s, vs padded, rows fwd, body tokens, …, grad bit-equal (8th)
    body, equal = 3, 7
    assert rows["padded"][equal] == "True" and rows["+ zero-skip"][equal] == "True"
    assert int(rows["+ shared prefix"][body]) < int(rows["padded"][body])
    assert int(rows["both"][body]) < int(rows["+ zero-skip"][body]) < int(rows["padded"][body])


@pytest.mark.slow
def test_memory_benchmark_prints_both_cases_for_every_step():
    out = _run(
        "benchmarks/memory.py",
        "--steps",
        "2",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "agl_lab.model.warm_start_steps=0",
    )
    rows = _rows(out, "case")
    assert set(rows) == {f"{case}@{step}" for case in ("no-trim", "trim") for step in (1, 2)}
    for cells in rows.values():
        assert float(cells[2]) >= float(cells[3]) > 0  # the peak is never below the size after the trim


def _trl_benchmark():
    """benchmarks/trl_side_by_side.py as a module (benchmarks/ is no package); importing it needs no TRL."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_side_by_side", ROOT / "benchmarks" / "trl_side_by_side.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_side_by_side_builds_its_venv_with_the_pins_and_runs_each_case_in_its_own_python(tmp_path):
    bench = _trl_benchmark()
    make, install = bench.venv_commands(tmp_path / ".venv-trl", python="python3.11")
    assert make == ["python3.11", "-m", "venv", str(tmp_path / ".venv-trl")]
    assert install[:4] == [str(tmp_path / ".venv-trl" / "bin" / "python"), "-m", "pip", "install"]
    assert {"trl==1.16.0", "torch==2.13.0"} <= set(install[4:])
    agl = bench.case_command("agl_lab", "/models/smol", 3, 1)
    assert agl[0] == sys.executable and agl[2:] == [
        "--child",
        "agl_lab",
        "--model-dir",
        "/models/smol",
        "--steps=3",
        "--seed=1",
    ]
    trl = bench.case_command("trl", "/models/smol", 2, 0)
    assert trl[0] == str(ROOT / ".venv-trl" / "bin" / "python") and trl[3] == "trl"


def test_trl_side_by_side_summarises_steps_after_the_first_and_prints_the_lead():
    bench = _trl_benchmark()

    def row(step_s, gen_s, gen_tokens, batch_tokens, rss_gb, reward):
        return dict(
            step_s=step_s,
            cpu_s=2 * step_s,
            gen_s=gen_s,
            gen_tokens=gen_tokens,
            batch_tokens=batch_tokens,
            rss_gb=rss_gb,
            reward=reward,
        )

    agl = bench.summary(
        [row(100, 90, 10, 10, 3.0, 0.2), row(20, 10, 100, 500, 3.5, 0.4), row(30, 10, 50, 1000, 3.2, 0.6)]
    )
    # steps 2..3: step_s median(20, 30); gen_tok/s median(100/10, 50/10); upd_tok/s median(500/10, 1000/20)
    assert agl == {
        "step_s": 25,
        "cpu_s": 50,
        "gen_s": 10,
        "gen_tok/s": 7.5,
        "upd_s": 15,
        "upd_tok/s": 50,
        "rss_gb": 3.5,
        "reward": 0.4,
    }
    trl = bench.summary([row(250, 200, 100, 2000, 3.8, 0.5)])  # one step: step 1 itself
    assert trl == {
        "step_s": 250,
        "cpu_s": 500,
        "gen_s": 200,
        "gen_tok/s": 0.5,
        "upd_s": 50,
        "upd_tok/s": 40,
        "rss_gb": 3.8,
        "reward": 0.5,
    }
    lines = bench.table({"agl_lab": agl, "trl": trl}, steps=3)
    assert lines[0].startswith("| case (median of steps 2..3) | step_s | cpu_s | gen_s | gen_tok/s |")
    assert lines[2].startswith("| agl_lab | 25.00 | 50.00 | 10.00 | 7.50 |") and lines[3].startswith("| trl | 250.00 |")
    # seconds and RSS: TRL's / agl_lab's; rates: agl_lab's / TRL's
    assert lines[4] == "| agl_lab's lead (×) | 10.0 | 10.0 | 20.0 | 15.0 | 3.3 | 1.2 | 1.1 | |"
    assert bench.table({"trl": trl}, steps=1)[0].startswith("| case (step 1 (warm-up included)) |")
    assert len(bench.table({"trl": trl}, steps=1)) == 3  # no lead line without both cases


@pytest.mark.parametrize(
    ("argv", "message"), [(["--steps", "0"], "--steps must be ≥ 1"), (["--cases", "agl_lab,vllm"], "unknown ['vllm']")]
)
def test_trl_side_by_side_refuses_bad_arguments_before_building_anything(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        _trl_benchmark().main(argv)


def test_trl_side_by_side_reads_a_case_s_rows_as_they_come_and_names_a_failed_case(capsys):
    bench = _trl_benchmark()
    child = "print('NOTE hello'); print('noise'); print('ROW {\"step_s\": 2.0}'); print('ROW {\"step_s\": 3.0}')"
    assert bench.run_case("demo", [sys.executable, "-c", child]) == [{"step_s": 2.0}, {"step_s": 3.0}]
    assert capsys.readouterr().out.splitlines() == [
        "#   hello",
        '#   demo step 1: {"step_s": 2.0}',
        '#   demo step 2: {"step_s": 3.0}',
    ]
    with pytest.raises(SystemExit, match=r"case demo failed:[\s\S]*ValueError: no weights"):
        bench.run_case("demo", [sys.executable, "-c", "raise ValueError('no weights')"])


@pytest.mark.slow
def test_overlap_benchmark_prints_the_bfloat16_cases_and_the_gap_they_open():
    """`overlap.py` on the tiny model, one step a case: the float32 step's engine-vs-trainer gap is
    float32 noise, the bfloat16 one's is not (agl_lab.model.compute_dtype acts in both places)."""
    small = [
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    ]
    out = _run(
        "benchmarks/overlap.py",
        "--config=configs/cpu_tiny.yaml",
        "--steps=1",
        "--no-val",
        "--cases=sync,sync-bf16-gap",
        *small,
        "agl_lab.model.warm_start_steps=0",
        timeout=600,
    )
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("case "))
    columns = [c.strip() for c in header.split("|")]
    gap = columns.index("lp_gap")
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in lines if " | " in line}
    assert float(rows["sync"][gap]) < 1e-4
    assert 1e-4 < float(rows["sync-bf16-gap"][gap]) < 1.0


def test_precision_benchmark_prints_both_tables_with_a_gap_between_the_precisions():
    out = _run("benchmarks/precision.py", "--preset=tiny", "--repeat=1", "--threads=1", "--rows=4", "--tokens=16")
    assert re.search(r"^decode lm head, M=4 +\| +[\d.]+ \| +[\d.]+ \| +[\d.]+×$", out, flags=re.M)
    assert re.search(r"^update mlp up, M=64 +\|", out, flags=re.M)
    row = next(line for line in out.splitlines() if line.startswith("fwd+bwd 4×16 tokens"))
    gap = float(row.split("|")[-1])
    assert 1e-4 < gap < 0.5  # the autocast pass really ran in bfloat16


def test_phase_profile_prints_its_cases_with_the_phase_split():
    """`phase_profile.py` on the tiny model, two steps a case: each case's rows (and `--before`'s, this
    checkout again), the phase's prefills, decode steps and the engine thread's CPU share read from a
    real training run."""
    out = _run(
        "benchmarks/phase_profile.py",
        "--config=configs/cpu_tiny.yaml",
        "--steps=2",
        "--repeat=1",
        "--cases=hf-prefill,fast-prefill,fast-prefill-bf16",
        f"--before={ROOT}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "agl_lab.model.warm_start_steps=0",
        timeout=600,
    )
    lines = out.splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("case ")).split("|")]
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in lines if " | " in line}
    for case in ("before", "hf-prefill", "fast-prefill", "fast-prefill-bf16"):
        cells = dict(zip(header, rows[case]))
        assert float(cells["prefills"]) >= 1 and float(cells["steps"]) >= 1
        assert float(cells["prefill_s"]) > 0 and float(cells["decode_ms"]) > 0
        assert 0 < float(cells["engine_cpu"]) <= 2.5  # the engine thread's CPU over the phase's wall
        assert 0 < float(cells["forward"]) < 1  # the engine's forward seconds over the phase's wall
        assert float(cells["step_s"]) >= float(cells["rollout_s"])
    _assert_host_lines(out)


def test_a_child_case_s_rows_come_back_by_tag_and_a_failed_case_is_named():
    from benchmarks.children import run_child, tagged

    lines = run_child("print('noise'); print('ROW [1, 2]'); print('VAL 0.5'); print('ROW {\"a\": 3}')", [], "demo")
    assert tagged(lines) == [[1, 2], {"a": 3}] and tagged(lines, "VAL") == [0.5]
    with pytest.raises(SystemExit, match=r"demo case failed:[\s\S]*ValueError: no weights"):
        run_child("raise ValueError('no weights')", [], "demo case")


def test_phase_profile_refuses_a_before_that_is_not_a_checkout(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/phase_profile.py", f"--before={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and f"--before {tmp_path}: not an agl_lab checkout" in done.stderr


def test_decode_step_benchmark_compares_a_revision_s_module_row_by_row():
    """`decode_step.py` on the tiny model against this very revision: every row size, and the same
    module gives the same logits (|Δ| 0), so the two decodes really ran side by side on one batch."""
    from agl_lab.engines.tiny import tiny_model_dir

    out = _run(
        "benchmarks/decode_step.py", "--before=HEAD", "--rows=1,3", "--steps=5", f"--model-path={tiny_model_dir()}"
    )
    rows = _rows_by_first_cell(out)
    assert set(rows) == {"rows", "1", "3"}
    for n in ("1", "3"):
        _, before_ms, now_ms, _, dlogit = rows[n]
        assert float(before_ms) > 0 and float(now_ms) > 0 and float(dlogit) == 0
    _assert_host_lines(out)


def test_shared_block_benchmark_runs_both_layouts_on_the_same_tokens():
    """`shared_block.py` on the tiny model: every row size, both layouts timed, and the block's logits
    equal the copied prefix's to float32 rounding (the two decoded the same tokens)."""
    from agl_lab.engines.tiny import tiny_model_dir

    out = _run(
        "benchmarks/shared_block.py", "--rows=1,3", "--prefix=40", "--suffix=3", "--steps=5",
        f"--model-path={tiny_model_dir()}",
    )  # fmt: skip
    rows = _rows_by_first_cell(out)
    assert set(rows) == {"rows", "1", "3"}
    for n in ("1", "3"):
        _, *ms, ratio, dlogit = rows[n]
        assert all(float(m) > 0 for m in ms) and float(ratio) > 0 and float(dlogit) < 1e-4
    _assert_host_lines(out)


def test_openmp_pools_benchmark_times_both_cases_for_every_row_size():
    from agl_lab.engines.tiny import tiny_model_dir

    out = _run(
        "benchmarks/openmp_pools.py", "--rows=1,3", "--steps=5", "--repeat=1", f"--model-path={tiny_model_dir()}"
    )
    rows = _rows_by_first_cell(out)
    assert set(rows) == {"rows", "1", "3"}
    for n in ("1", "3"):
        _, kept, released, ratio = rows[n]
        assert float(kept) > 0 and float(released) > 0 and float(ratio) > 0
    _assert_host_lines(out)


def test_first_step_benchmark_plays_both_phases_and_sends_each_call_once():
    """`first_step.py` on the tiny model beside one busy loop: both phases' rows, every call the
    gateway recorded reached the engine once, no LoRA merge on the decode path, the runnable
    threads sampled during each phase."""
    from agl_lab.engines.tiny import tiny_model_dir

    out = _run(
        "benchmarks/first_step.py",
        "--groups=1",
        "--n=2",
        "--busy=1",
        "--max-model-len=1024",
        f"--model-path={tiny_model_dir()}",
    )
    rows = {row["phase"]: row for row in map(ast.literal_eval, re.findall(r"^\{'phase'.*\}$", out, re.M))}
    assert set(rows) == {"first", "later"}
    for row in rows.values():
        assert row["failed rollouts"] == 0 and row["model calls"] >= 2, row
        assert row["generations"] == row["model calls"], row  # each call reached the engine once
        assert row["LoRA merges in phase"] == 0 and row["timeout extensions"] == 0, row
        assert row["runnable"] >= 1, row  # the busy loop at least
    assert re.search(r"^ +seconds +failed rollouts .* runnable$", out, re.M)  # the table's header
    assert "first / later:" in out


def test_busy_loops_end_with_the_process_that_started_them_even_one_killed():
    """`benchmarks.children.busy_loops` (the load beside `first_step.py`, `threads.py`, ...): a benchmark
    killed with SIGKILL runs no `finally`, and its busy loops still end (each watches its parent)."""
    code = (
        "import os, signal\nfrom benchmarks.children import busy_loops\n"
        "with busy_loops(1, settle=0) as loops:\n"
        "    print(loops[0].pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    stat = Path(f"/proc/{int(done.stdout.split()[0])}/stat")
    for _ in range(300):  # an orphan notices its new parent within a loop iteration; allow a loaded machine
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the busy loop outlived the killed benchmark: {stat.read_text()}")


def test_decode_step_benchmark_names_a_revision_git_does_not_know():
    done = subprocess.run(
        [sys.executable, "benchmarks/decode_step.py", "--before=no-such-rev"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode != 0 and "--before no-such-rev" in done.stderr


def test_lora_update_benchmark_times_the_forwards_and_the_merged_ones_run_fewer_products():
    """`lora_update.py` on the tiny recipe with LoRA: a row per case, and PEFT's forward makes more
    `aten::mm` calls than the merged product (three products a projection against one) — in float32
    and under bfloat16 (autocast runs PEFT's layer; the copies the merged product)."""
    out = _run(
        "benchmarks/lora_update.py",
        "--config=configs/cpu_tiny.yaml",
        "--repeat=1",
        "--cases=merged,peft,merged-bf16,autocast-bf16,verl-scores,sdpa",
        "actor_rollout_ref.model.lora_rank=4",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "agl_lab.model.warm_start_steps=0",
        timeout=600,
    )
    rows = _rows_by_first_cell(out)
    assert all(
        float(rows[case][1]) > 0 for case in ("merged", "peft", "merged-bf16", "autocast-bf16", "verl-scores", "sdpa")
    )
    assert int(rows["peft"][3]) > int(rows["merged"][3]) > 0
    assert int(rows["autocast-bf16"][3]) > int(rows["merged-bf16"][3]) > 0
    # the tiny model has as many KV heads as query heads: no grouped attention, and the case says so
    assert "# case sdpa: this model runs 'sdpa', not the grouped attention" in out
    _assert_host_lines(out)


def test_lora_update_benchmark_names_an_unknown_case():
    done = subprocess.run(
        [sys.executable, "benchmarks/lora_update.py", "--cases=merged,fp8"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode != 0 and "--cases: unknown ['fp8']" in done.stderr


def test_micro_batches_benchmark_times_each_case_and_the_chosen_order_pads_no_more():
    """`micro_batches.py` on the tiny recipe: a row per ROWS:ORDER case with seconds, body tokens and
    peak RSS; the order `local_ppo._forward_plan` chooses sends no more tokens than the batch's."""
    out = _run(
        "benchmarks/micro_batches.py",
        "--config=configs/cpu_tiny.yaml",
        "--repeat=1",
        "--cases=2:batch,2:chosen",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "agl_lab.model.warm_start_steps=0",
        "agl_lab.algorithm.skip_zero_advantage=false",  # every micro-batch forwarded, zero rewards or not
        timeout=600,
    )
    rows = _rows_by_first_cell(out)
    assert set(rows) == {"case", "2:batch", "2:chosen"}
    batch, chosen = rows["2:batch"], rows["2:chosen"]
    assert float(batch[1]) > 0 and float(chosen[1]) > 0 and float(batch[5]) > 0
    assert batch[4] == "0" and 0 < float(chosen[3]) <= float(batch[3])
    _assert_host_lines(out)


def test_micro_batches_benchmark_names_a_malformed_case():
    done = subprocess.run(
        [sys.executable, "benchmarks/micro_batches.py", "--cases=2:batch,four:chosen"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "--cases: 'four:chosen' is not ROWS:ORDER" in done.stderr


def _assert_host_lines(out: str) -> None:
    """A timed benchmark names its host before its cases and after them (`benchmarks/host.py`): the CPU
    model and the float32 and bfloat16 matmul rates measured then."""
    import re

    hosts = [line for line in out.splitlines() if line.startswith("# host: ")]
    assert len(hosts) == 2, out
    for line in hosts:
        rates = re.search(r"float32 matmul (\d+) GFLOP/s, bfloat16 (\d+) GFLOP/s", line)
        assert rates and int(rates[1]) > 0 and int(rates[2]) > 0, line
