r"""Claiming under contention: rollouts/s end to end with 1/16/64 runners, per store backend,
agl_lab's batch claim beside the list-then-PATCH path AGL clients use, and Agent Lightning's
own server in the same run.

One run = a fresh server process, N rollouts, R runners:

    producer (this process)  create N rollouts (batches of 64) -> follow the terminal cursor ->
                             fetch each terminal rollout (GET rollout + GET events) -> DELETE
    R runners                claim one rollout -> POST a reward event -> PATCH succeeded,
                             until the producer has fetched all N

The runners are threads spread over up to 4 worker processes (one httpx client each), so the
client side is not one GIL. Two claim paths:

    claim       POST /api/rollouts/claim {"limit": 1, "wait_seconds": 0.5}: each rollout to exactly
                one runner; an idle runner's claim waits on the server (long poll) (agl_lab's Runner)
    list+PATCH  GET /api/rollouts?state_in=queuing&limit=17, then PATCH running on the first
                queued one; a 409 (another runner took it) -> try the next; an empty listing sleeps
                0.05 s, the Runner's poll interval (AGL's controllers; agl_lab's Runner on an AGL server)

Columns per backend: rollouts/s (N / wall from the first create to the last fetch), 409/claim
(conflicting PATCHes per successful claim) and rollouts per server CPU-second (the server
process's user+system time, /proc). A backend is one entry of BACKENDS. PostgreSQL runs on a
throwaway server this script starts (`--postgres auto`, the default where `initdb` is installed:
tests/postgres.py, one fresh database per run) or on `--postgres URL`; `--postgres none` skips it.
AGL runs when `--agl-python PATH` names a Python with
`agentlightning` installed (benchmarks/batch.py's docstring has the recipe; default
/tmp/agl-venv/bin/python when it exists); its server has no claim route, so its claim row says
"n/a". Without it the AGL columns say why they are empty.

    python benchmarks/claims.py [--rollouts 400] [--runners 1 16 64] [--postgres auto|URL|none]
                                [--agl-python PATH] [--no-agl] [--paths claim list+PATCH]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "claims-bench-key"
DEFAULT_AGL_PYTHON = "/tmp/agl-venv/bin/python"
PATHS = ("claim", "list+PATCH")
CLAIM_WAIT_SECONDS = 0.5  # the long poll of agl_lab's Runner (runner.CLAIM_WAIT_SECONDS)
IDLE_SLEEP_SECONDS = 0.05  # an empty list-then-PATCH poll sleeps this long (the Runner's poll_interval)
# backend name -> (server kind, store URL template; {tmp} is the run's temporary directory)
BACKENDS: dict[str, tuple[str, str]] = {
    "memory": ("agl_lab", "memory"),
    "sqlite": ("agl_lab", "sqlite:///{tmp}/store.db"),
    "postgresql": ("agl_lab", "{pg}"),
    "AGL 1.0.2": ("agl", ""),
}
_PG: dict[str, object] = {}  # "new": () -> a fresh database URL, while a PostgreSQL is available


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(kind: str, store: str, tmp: str, agl_python: str | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    if kind == "agl_lab":
        url = store.format(tmp=tmp, pg=_PG["new"]() if "{pg}" in store else "")
        argv = [
            sys.executable,
            "-m",
            "agl_lab.cli",
            "serve",
            "--port",
            str(port),
            "--key",
            KEY,
            "--model-name",
            "m",
            "--store",
            url,
            "--log-level",
            "warning",
        ]
        cwd = ROOT
    else:
        argv = [
            agl_python,
            "-I",
            "-m",
            "agentlightning.server",
            "host=127.0.0.1",
            f"port={port}",
            f"key={KEY}",
            f"hydra.run.dir={tmp}/hydra",
            "hydra.output_subdir=null",
            "hydra/job_logging=none",
            "hydra/hydra_logging=none",
        ]
        cwd = tmp
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{kind} server did not answer /healthz within 60 s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# Runners (worker processes of threads)
# ---------------------------------------------------------------------------------------------


def _claim_one(http: httpx.Client, path: str, runner_id: str, counts: dict[str, int]) -> str | None:
    if path == "claim":
        answer = http.post(
            "/api/rollouts/claim", json={"limit": 1, "runner_id": runner_id, "wait_seconds": CLAIM_WAIT_SECONDS}
        )
        answer.raise_for_status()
        claimed = answer.json()
        return claimed[0]["rollout_id"] if claimed else None
    queued = http.get("/api/rollouts", params={"state_in": "queuing", "limit": 17})
    queued.raise_for_status()
    for rollout in queued.json():
        answer = http.patch(
            f"/api/rollouts/{rollout['rollout_id']}", json={"status": {"state": "running", "last_attempt_id": "0"}}
        )
        if answer.status_code == 200:
            return rollout["rollout_id"]
        if answer.status_code not in (404, 409):
            answer.raise_for_status()
        counts["conflicts"] += 1
    return None


def _runner_thread(url: str, path: str, runner_id: str, stop, out: list) -> None:
    counts = {"claims": 0, "conflicts": 0, "requests_idle": 0}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        while not stop.is_set():
            rid = _claim_one(http, path, runner_id, counts)
            if rid is None:
                counts["requests_idle"] += 1
                if path != "claim":  # the claim waited on the server already
                    time.sleep(IDLE_SLEEP_SECONDS)
                continue
            counts["claims"] += 1
            http.post(
                f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "reward", "data": {"value": 1.0}}
            ).raise_for_status()
            http.patch(f"/api/rollouts/{rid}", json={"status": {"state": "succeeded"}}).raise_for_status()
    out.append(counts)


def _worker(url: str, path: str, n_threads: int, tag: str, stop, results) -> None:
    out: list[dict[str, int]] = []
    threads = [
        threading.Thread(target=_runner_thread, args=(url, path, f"{tag}-{i}", stop, out)) for i in range(n_threads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put({k: sum(c[k] for c in out) for k in ("claims", "conflicts", "requests_idle")})


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------


def produce(url: str, n: int) -> None:
    """Create n rollouts, follow the terminal cursor, fetch and delete each terminal one."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        cursor = http.get("/api/rollouts/terminal", params={"after": 0, "limit": 1}).json()["total_terminal"]
        ids = [secrets.token_hex(16) for _ in range(n)]
        for i in range(0, n, 64):
            http.post(
                "/api/rollouts", json=[{"rollout_id": rid, "input": {"i": rid}} for rid in ids[i : i + 64]]
            ).raise_for_status()
        wanted, fetched = set(ids), 0
        while fetched < n:
            page = http.get("/api/rollouts/terminal", params={"after": cursor, "limit": 1000}).json()
            cursor = page["next_after"]
            for item in page["items"]:
                if item["rollout_id"] not in wanted:
                    continue
                rid = item["rollout_id"]
                http.get(f"/api/rollouts/{rid}").raise_for_status()
                http.get(f"/api/rollouts/{rid}/events").raise_for_status()
                http.delete(f"/api/rollouts/{rid}")
                wanted.discard(rid)
                fetched += 1
            if not page["items"]:
                time.sleep(0.01)


def run_one(backend: str, path: str, n_runners: int, n_rollouts: int, agl_python: str | None) -> dict[str, float]:
    kind, store = BACKENDS[backend]
    tmp = tempfile.mkdtemp(prefix="agl-claims-")
    proc, url = start_server(kind, store, tmp, agl_python)
    ctx = mp.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    n_procs = min(4, n_runners)
    sizes = [n_runners // n_procs + (i < n_runners % n_procs) for i in range(n_procs)]
    workers = [ctx.Process(target=_worker, args=(url, path, k, f"w{i}", stop, results)) for i, k in enumerate(sizes)]
    try:
        for w in workers:
            w.start()
        time.sleep(1.0)  # the workers' imports and first idle claims, before the clock starts
        cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        produce(url, n_rollouts)
        wall, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid) - cpu0
        stop.set()
        totals = [results.get(timeout=60) for _ in workers]
        for w in workers:
            w.join(30)
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    claims = sum(t["claims"] for t in totals)
    return {
        "rollouts_per_s": n_rollouts / wall,
        "conflicts_per_claim": sum(t["conflicts"] for t in totals) / max(claims, 1),
        "per_cpu_s": n_rollouts / cpu if cpu > 0 else float("nan"),
        "claims": claims,
    }


# ---------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------


def agl_python_of(args: argparse.Namespace) -> tuple[str | None, str]:
    """(python, why) for the AGL server: the interpreter, or None and why it is not run."""
    if args.no_agl:
        return None, "--no-agl"
    python = args.agl_python or (DEFAULT_AGL_PYTHON if os.path.exists(DEFAULT_AGL_PYTHON) else None)
    if python is None:
        return None, f"no --agl-python and no {DEFAULT_AGL_PYTHON} (benchmarks/batch.py's docstring: the recipe)"
    check = subprocess.run([python, "-I", "-c", "import agentlightning.server.app"], capture_output=True, text=True)
    if check.returncode:
        return None, f"{python} cannot import agentlightning.server.app: {check.stderr.strip()[-200:]}"
    return python, python


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=400)
    p.add_argument("--runners", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument(
        "--postgres",
        default="auto",
        metavar="auto|URL|none",
        help="PostgreSQL for the postgresql column: a throwaway server (auto), a database URL, or none",
    )
    p.add_argument("--agl-python", default=None)
    p.add_argument("--no-agl", action="store_true")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS), help="claim paths to run")
    args = p.parse_args(argv)
    agl_python, agl_why = agl_python_of(args)
    with postgres(args.postgres) as pg_why:
        backends = [
            b
            for b in args.backends
            if (BACKENDS[b][0] != "agl" or agl_python is not None) and (b != "postgresql" or "new" in _PG)
        ]
        measure_and_print(args, backends, agl_python, agl_why, pg_why)


@contextlib.contextmanager
def postgres(given: str) -> Iterator[str]:
    """Make `_PG["new"]` hand out database URLs; yields what the postgresql column ran on (or why not)."""
    if given == "none":
        yield "--postgres none"
    elif given != "auto":
        _PG["new"] = lambda: given  # one database given: each run starts on what the last one left
        yield given
    elif shutil.which("initdb") is None:
        yield "initdb not installed (PostgreSQL 15's server binaries; or pass --postgres URL)"
    else:
        sys.path.insert(0, str(ROOT))
        from tests.postgres import PostgresCluster

        cluster = PostgresCluster.start()
        _PG["new"] = cluster.create_database
        try:
            yield "a throwaway PostgreSQL (tests/postgres.py, fsync off), one fresh database per run"
        finally:
            _PG.pop("new", None)
            cluster.stop()


def measure_and_print(
    args: argparse.Namespace, backends: list[str], agl_python: str | None, agl_why: str, pg_why: str
) -> None:
    cells: dict[tuple[str, int, str], dict[str, float] | None] = {}
    for n_runners in args.runners:  # backends take turns per runner count: load drifts hit all alike
        for path in args.paths:
            for backend in backends:
                if BACKENDS[backend][0] == "agl" and path == "claim":
                    cells[(path, n_runners, backend)] = None  # AGL has no claim route
                    continue
                cells[(path, n_runners, backend)] = run_one(backend, path, n_runners, args.rollouts, agl_python)
    header = f"{'path':<11}| {'runners':>7} |" + "|".join(
        f" {b + ' r/s':>15} | {'409/claim':>9} | {'r/CPU-s':>8} " for b in backends
    )
    print(
        f"\n{args.rollouts} rollouts per run, create -> claim -> event -> succeeded -> fetch + delete "
        f"({os.cpu_count()} cores)\n"
    )
    print(header)
    print("-" * len(header))
    for n_runners in args.runners:
        for path in args.paths:
            row = f"{path:<11}| {n_runners:>7} |"
            for backend in backends:
                cell = cells[(path, n_runners, backend)]
                row += (
                    f" {'n/a':>15} | {'n/a':>9} | {'n/a':>8} "
                    if cell is None
                    else f" {cell['rollouts_per_s']:>15.1f} | {cell['conflicts_per_claim']:>9.2f} | "
                    f"{cell['per_cpu_s']:>8.1f} "
                ) + "|"
            print(row.rstrip("|"))
    print(f"\nPostgreSQL: {pg_why}")
    if agl_python is None:
        print(f"\nAGL columns absent: {agl_why}")
    else:
        print(f"\nAGL 1.0.2 server: {agl_why} -m agentlightning.server (its in-memory store; no claim route: n/a)")


if __name__ == "__main__":
    main()
