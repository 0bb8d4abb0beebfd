"""docs/many-machines.md's commands, run as written on loopback.

The section "The commands, on real hosts" is parsed into its ```bash blocks. The settings block
is the one the test does not run: it gives the same variables loopback values (`BIND=127.0.0.1`,
free ports, a throwaway PostgreSQL as `STORE`, `HOME` a temporary directory for `~/agl`) and
checks the block exports exactly those names. Every other block runs verbatim through bash, with
`agl-lab` on PATH as this checkout's `python -m agl_lab.cli`; the trainer's command gets the
test's small-run overrides appended. The database block (psql, createdb) is left out: the
database comes from tests/postgres.py.

1. keys, two servers on one PostgreSQL database, the trainer on server 1, a runner with the
   runner key on server 2: the run trains its steps, and server 2's `/metrics` (read with the
   runner key) counts the claims of every rollout;
2. the smaller layout: the trainer's embedded server on `agl_lab.server.port` prints its URL,
   and a runner given that URL (and the runner key) runs the rollouts;
3. "Runners on a Ray cluster": its own settings block (`RAY_HEAD`, the address of a head the test
   starts with `ray start --head` beside a second `ray start --address` node, one CPU each) and its
   runner block run verbatim against the keys block and one server-1 block (SQLite store), the
   section's `my_agents:solve` written as a module on PYTHONPATH: every rollout succeeds as attempt
   "0", and the agents ran on both nodes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.processes import stop_groups
from tests.prometheus import parse, value
from tests.timescale import scaled
from tests.trainer_runs import SMALL

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "many-machines.md"
SETTINGS = {"BIND", "PORT", "SERVER", "TRAINER_HOST", "STORE", "KEYS"}
COMMANDS = "## The commands, on real hosts"
RAY = "## Runners on a Ray cluster"
RAY_SETTINGS = {"RAY_HEAD"}
STEPS = 2


def doc_blocks(heading: str = COMMANDS) -> dict[str, str]:
    """The section's bash blocks by their first line (a comment naming where they run)."""
    text = DOC.read_text()
    section = text[text.index(heading) :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return {block.splitlines()[0]: block for block in blocks}


def block(prefix: str, heading: str = COMMANDS) -> str:
    (found,) = [b for first, b in doc_blocks(heading).items() if first.startswith(prefix)]
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def shell(tmp_path):
    """run(script, log name, background, **settings) -> Popen: bash in the checkout, `agl-lab` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "agl-lab"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m agl_lab.cli "$@"\n')
    shim.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    base = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "HOME": str(home),
        "KEYS": str(home / "agl"),
        "BIND": "127.0.0.1",
        "TRAINER_HOST": "127.0.0.1",
    }
    for name in ("AGL_KEY", "AGL_RUNNER_KEY", "AGL_ENGINE_KEY"):
        base.pop(name, None)
    procs: list[subprocess.Popen] = []

    def run(script: str, name: str, **settings: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed with the test's tmp_path)
        proc = subprocess.Popen(
            ["bash", "-euc", script],
            cwd=ROOT,
            env={**base, **settings},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc.log = tmp_path / f"{name}.log"  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    run.home = home  # type: ignore[attr-defined]
    yield run
    stop_groups(procs, 60)


def _wait(predicate, bound: float, what: str, watch=()) -> None:
    end = time.monotonic() + bound
    while not predicate():
        for proc in watch:
            assert proc.poll() is None, f"{what}: exited {proc.returncode}:\n{proc.log.read_text()[-3000:]}"
        assert time.monotonic() < end, f"timed out after {bound} s waiting for {what}"
        time.sleep(0.2)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _train_overrides(run_dir: Path) -> str:
    overrides = [*SMALL, f"trainer.total_training_steps={STEPS}", "--run-dir", str(run_dir)]
    return " " + " ".join(shlex.quote(o) for o in overrides)


def test_the_settings_block_names_what_the_other_blocks_read():
    settings = block("# settings")
    assert set(re.findall(r"^export (\w+)=", settings, re.M)) == SETTINGS
    used = set()
    for first, text in doc_blocks().items():
        if not first.startswith("# settings"):
            used |= set(re.findall(r"\$\{?(\w+)", text))
    assert SETTINGS <= used, SETTINGS - used
    assert "--key " not in "".join(doc_blocks().values())  # keys come from files or the environment


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_many_machines_commands_run_as_written(shell, postgres_database, tmp_path):
    keys = shell(block("# keys"), "keys")
    assert keys.wait(60) == 0, keys.log.read_text()
    key_dir = shell.home / "agl"
    assert sorted(p.name for p in key_dir.iterdir()) == ["admin.key", "engine.key", "runner.key"]
    assert all((key_dir / n).stat().st_mode & 0o077 == 0 for n in ("admin.key", "runner.key"))

    urls = [f"http://127.0.0.1:{_free_port()}" for _ in range(2)]
    servers = [
        shell(block("# server-1"), f"server{i}", PORT=url.rsplit(":", 1)[1], STORE=postgres_database, SERVER=url)
        for i, url in enumerate(urls)
    ]
    _wait(lambda: all(_healthy(u) for u in urls), 120, "both servers", servers)

    run_dir = tmp_path / "run"
    trainer = shell(
        block("# trainer-host: no embedded").rstrip() + _train_overrides(run_dir),
        "train",
        SERVER=urls[0],
        STORE=postgres_database,
    )
    runner = shell(block("# runner-1"), "runner", SERVER=urls[1], STORE=postgres_database)
    _wait(lambda: trainer.poll() is not None, 600, "the training", [*servers, runner])
    assert trainer.returncode == 0, trainer.log.read_text()[-4000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == STEPS

    runner_key = (key_dir / "runner.key").read_text().strip()
    scraped = httpx.get(urls[1] + "/metrics", headers={"Authorization": f"Bearer {runner_key}"}, timeout=30)
    samples = parse(scraped.text)
    assert value(samples, "agl_claimed_rollouts_total") >= STEPS * 8  # every rollout, by the runner on server 2
    assert value(samples, "agl_store_seconds_count", op="claim_rollouts") >= 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_smaller_layout_prints_the_url_runners_are_given(shell, tmp_path):
    keys = shell(block("# keys"), "keys")
    assert keys.wait(60) == 0, keys.log.read_text()
    smaller = block("# trainer-host: the embedded server")
    train_part, runner_part = smaller.split("\n# runner hosts")
    port = str(_free_port())
    run_dir = tmp_path / "run"
    trainer = shell(train_part.rstrip() + _train_overrides(run_dir), "train", PORT=port)
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: f"agl-lab train: server {url}" in trainer.log.read_text(), 300, "the printed URL", [trainer])
    runner = shell(runner_part, "runner", PORT=port)
    _wait(lambda: trainer.poll() is not None, 600, "the training", [runner])
    assert trainer.returncode == 0, trainer.log.read_text()[-4000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == STEPS  # the trainer has no runner: the one given the printed URL ran every rollout


# The Ray section's agent, as an operator's my_agents.py: it holds its rollout until the file
# `task["hold_file"]` exists (at most 300 s), so the test sees every agent running at once.
MY_AGENTS = """import os
import time


def solve(task, ctx):
    path = task.get("hold_file")
    end = time.monotonic() + 300
    while path and not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.2)
    return 1.0
"""
RAY_ROLLOUTS = 5  # > 4: at 0.25 Ray CPUs per agent a one-CPU node runs at most 4 at once


def test_the_ray_section_reads_only_settings():
    settings = block("# settings", RAY)
    assert set(re.findall(r"^export (\w+)=", settings, re.M)) == RAY_SETTINGS
    runner = block("# runner", RAY)
    assert set(re.findall(r"\$\{?(\w+)", runner)) == {"SERVER", "KEYS", "RAY_HEAD"}
    assert "--key " not in runner and "--key-file" in runner


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_ray_runner_command_runs_as_written(shell, tmp_path):
    """The Ray section's runner block, verbatim, against the keys block, a server-1 block (SQLite
    store) and two Ray nodes (`ray start --head`, `ray start --address`, one CPU each; tests/ray_env.py
    stops only their processes). `my_agents.py` is written to a directory on PYTHONPATH, as an
    operator's module would be; the runner ships it to the nodes."""
    ray = pytest.importorskip("ray")
    from agl_lab.client import AglClient
    from agl_lab.protocol import RolloutCreate
    from tests.ray_env import isolated_ray_env, node_index, node_of, ray_nodes

    keys = shell(block("# keys"), "keys")
    assert keys.wait(60) == 0, keys.log.read_text()
    key_dir = shell.home / "agl"
    url = f"http://127.0.0.1:{_free_port()}"
    store = f"sqlite:///{tmp_path / 'store.db'}"
    server = shell(block("# server-1"), "server", PORT=url.rsplit(":", 1)[1], STORE=store, SERVER=url)
    _wait(lambda: _healthy(url), scaled(120), "the server", [server])

    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "my_agents.py").write_text(MY_AGENTS)
    hold = tmp_path / "release"
    rollouts = [f"r{i}" for i in range(RAY_ROLLOUTS)]
    if ray.is_initialized():
        ray.shutdown()
    dirs: list[str] = []
    with isolated_ray_env("aglq"), ray_nodes(2, num_cpus=1, num_gpus=0, dirs_out=dirs) as address:
        nodes = node_index(address, dirs)
        assert sorted(nodes.values()) == [0, 1], nodes
        runner = shell(block("# runner", RAY), "runner", SERVER=url, RAY_HEAD=address, PYTHONPATH=f"{agents}:{ROOT}")
        try:
            with AglClient(url, key=(key_dir / "admin.key").read_text().strip()) as client:
                client.create_rollouts([RolloutCreate(rollout_id=r, input={"hold_file": str(hold)}) for r in rollouts])
                _wait(  # all held at once: more than one node can run
                    lambda: all(node_of(client, r) for r in rollouts), scaled(300), "every agent to start", [runner]
                )
                assert {node_of(client, r) for r in rollouts} == set(nodes)  # agents ran on both nodes
                hold.touch()
                _wait(lambda: all(client.get_rollout(r)[0].is_terminal for r in rollouts), scaled(300), "the rollouts")
                for r in rollouts:
                    rollout, attempts = client.get_rollout(r)
                    assert rollout.status.state == "succeeded" and attempts == ["0"], rollout.status
                    assert client.get_events(r, event_type="reward")[0]["data"] == {"value": 1.0}
            os.killpg(runner.pid, signal.SIGTERM)
            assert runner.wait(scaled(120)) == 0, runner.log.read_text()[-4000:]
        finally:
            if runner.poll() is None:
                os.killpg(runner.pid, signal.SIGKILL)
                runner.wait()
    out = runner.log.read_text()
    assert f"agents as Ray tasks on {address}" in out, out[-4000:]
    assert f"{RAY_ROLLOUTS} done ({RAY_ROLLOUTS} succeeded, 0 failed)" in out.strip().splitlines()[-1], out[-4000:]
