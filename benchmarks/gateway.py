"""How much latency does the gateway add to an agent's LLM call, and how fast does the store append?

    python benchmarks/gateway.py [--agents 32] [--calls 20] [--delay 0.2] [--upstream-client auto]

Processes as in a real run: fake OpenAI upstreams (`python -m tests.fakes`, vLLM-shaped
answers with prompt/response token ids and logprobs; one answers at once, one after `--delay`
seconds of "model time"), the gateway
(`agl-lab serve`, memory or SQLite store), and this script, whose asyncio agents alternate a
direct call to the upstream and a call through the gateway (same body, a ~1 KB conversation),
so both see the same machine load; agents start staggered over one model time, so they do not
call in lock-step (as real agents, whose model times differ, do not). Added latency = gateway percentile - direct percentile:
with 1 agent and no model time it is the pure per-call overhead; with `--agents` at once it
includes the queueing of a single-threaded gateway. "gw CPU ms/call" is the gateway
process's user+system CPU per proxied call (from /proc), the number least sensitive to load.

The second table measures `Store.append_event` with a model_request-sized payload, in process.
Timings depend on the machine and its load: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agl_lab.server.gateway import proxy_base_url  # noqa: E402
from agl_lab.server.store import open_store  # noqa: E402

MODEL = "bench-model"
MESSAGES = [{"role": "system", "content": "You are a careful math assistant. " * 4}] + [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "step by step " * 12}
    for i in range(6)
]


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(make_args, make_url, ready_json: dict | None = None, tries: int = 3) -> Iterator[tuple[str, int]]:
    """Start `python make_args(port)`; yield (base url, pid) once `make_url(port)` answers 200.

    A fresh free port per try: another program may grab the port between probe and bind."""
    for attempt in range(tries):
        port = free_port()
        proc = subprocess.Popen([sys.executable, *make_args(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        if _wait_ready(proc, make_url(port), ready_json):
            break
        proc.kill()
        proc.wait(10)
        if attempt == tries - 1:
            raise RuntimeError(f"{make_args(port)} did not start: {proc.stderr.read().decode()[-2000:]}")
    try:
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_ready(proc: subprocess.Popen, url: str, ready_json: dict | None) -> bool:
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if ready_json is None:
                r = httpx.get(url, trust_env=False)
            else:
                r = httpx.post(url, json=ready_json, trust_env=False)
            if r.status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------------------------------------
# Agents
# ---------------------------------------------------------------------------------------------


async def run_agents(direct_url: str, gateway_urls: list[str], calls: int, headers: dict[str, str],
                     stagger: float) -> tuple[list[float], list[float]]:
    """One asyncio task per gateway url; each alternates a direct and a proxied call, `calls` of
    each, so both see the same load -> (direct latencies ms, gateway latencies ms)."""
    n = len(gateway_urls)
    limits = httpx.Limits(max_connections=2 * n + 8, max_keepalive_connections=2 * n + 8)
    # the body the gateway forwards in train mode, so the upstream does the same work either way
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 1.0, "return_token_ids": True, "logprobs": True}
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=60, trust_env=False) as client:
        async def call(base: str, out: list[float]) -> None:
            t0 = time.perf_counter()
            r = await client.post(base + "/chat/completions", json=body)
            out.append((time.perf_counter() - t0) * 1000)
            r.raise_for_status()

        async def agent(i: int, gw: str, direct: list[float], through: list[float], k: int,
                        stagger: float = 0.0) -> None:
            await asyncio.sleep(stagger * i / n)
            for j in range(k):
                pair = [(direct_url, direct), (gw, through)]
                for base, out in pair if (i + j) % 2 == 0 else pair[::-1]:
                    await call(base, out)

        await asyncio.gather(*(agent(i, gw, [], [], 3) for i, gw in enumerate(gateway_urls)))  # warm-up
        direct: list[float] = []
        through: list[float] = []
        await asyncio.gather(*(agent(i, gw, direct, through, calls, stagger) for i, gw in enumerate(gateway_urls)))
    return direct, through


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_rows(args: argparse.Namespace, upstreams: dict[float, str], store: str) -> list[list[str]]:
    key = "bench-key"
    cmd = lambda port: ["-m", "agl_lab.cli", "serve", "--port", str(port), "--key", key,  # noqa: E731
                        "--model-name", MODEL, "--store", store, "--log-level", "warning",
                        "--upstream-client", args.upstream_client]
    rows = []
    headers = {"Authorization": f"Bearer {key}"}
    with process(cmd, lambda port: f"http://127.0.0.1:{port}/healthz") as (url, pid):
        admin = httpx.Client(base_url=url, headers=headers, trust_env=False)
        ids = [f"bench-{i}" for i in range(args.agents)]
        admin.post("/api/rollouts", json=[{"rollout_id": r, "input": {}} for r in ids]).raise_for_status()
        for agents, delay in [(1, 0.0), (args.agents, args.delay)]:
            admin.delete("/api/models").raise_for_status()
            admin.post("/api/models", json=[{"model": MODEL, "endpoint": upstreams[delay] + "/v1"}]).raise_for_status()
            calls = args.calls if agents > 1 else args.calls * 8
            cpu0 = cpu_seconds(pid)
            direct, through = asyncio.run(run_agents(upstreams[delay] + "/v1",
                                                     [proxy_base_url(url, r) for r in ids[:agents]], calls, headers,
                                                     stagger=delay))
            cpu_ms = (cpu_seconds(pid) - cpu0) * 1000 / (len(through) + 3 * agents)
            d50, d99, g50, g99 = pct(direct, 50), pct(direct, 99), pct(through, 50), pct(through, 99)
            rows.append([store.split(":")[0], str(agents), f"{delay * 1000:.0f}", str(len(through)),
                         f"{d50:.2f}", f"{g50:.2f}", f"{g50 - d50:+.2f}", f"{d99:.2f}", f"{g99:.2f}",
                         f"{g99 - d99:+.2f}", f"{cpu_ms:.2f}"])
        admin.close()
    return rows


# ---------------------------------------------------------------------------------------------
# Store throughput
# ---------------------------------------------------------------------------------------------


def store_rows(n_events: int, tmp: str) -> list[list[str]]:
    prompt = list(range(600))
    data = {"model": MODEL, "model_version": 0, "request": {"model": MODEL, "messages": MESSAGES},
            "response": {"prompt_token_ids": prompt, "choices": [{"token_ids": list(range(64)),
                         "logprobs": {"content": [{"logprob": -0.1}] * 64}}]},
            "server": {"model": MODEL, "endpoint": "http://x/v1", "version": 0}, "latency_ms": 1.0,
            "http_status": 200, "status": "ok", "retry_count": 0, "usage": None, "finish_reason": "stop"}
    from agl_lab.protocol import RolloutCreate

    rows = []
    for url in ("memory", f"sqlite:///{tmp}/bench-store.db"):
        store = open_store(url)
        store.create_rollouts([RolloutCreate(rollout_id=f"s{i}", input={}) for i in range(32)])
        t0 = time.perf_counter()
        for i in range(n_events):
            store.append_event(f"s{i % 32}", "0", "model_request", data)
        append_rate = n_events / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        n_read = sum(len(store.events(f"s{i}")) for i in range(32))
        read_rate = n_read / (time.perf_counter() - t0)
        store.close()
        rows.append([url.split(":")[0], str(n_events), f"{append_rate:,.0f}", f"{read_rate:,.0f}"])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [" | ".join(h.rjust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--calls", type=int, default=20, help="calls per agent and route (x8 for the 1-agent run)")
    p.add_argument("--delay", type=float, default=0.2, help="upstream model time per call with --agents (s)")
    p.add_argument("--events", type=int, default=5000)
    p.add_argument("--upstream-client", default="auto", choices=["auto", "aiohttp", "httpx"])
    args = p.parse_args()
    print(f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} agents={args.agents} calls={args.calls} "
          f"model time={args.delay * 1000:.0f} ms upstream client={args.upstream_client}")
    fake = lambda delay: lambda port: ["-m", "tests.fakes", "--port", str(port), "--delay", str(delay)]  # noqa: E731
    ready = lambda port: f"http://127.0.0.1:{port}/v1/chat/completions"  # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        with process(fake(0.0), ready, ready_json={"messages": []}) as (fast, _), \
                process(fake(args.delay), ready, ready_json={"messages": []}) as (slow, _):
            upstreams = {0.0: fast, args.delay: slow}
            rows += gateway_rows(args, upstreams, "memory")
            rows += gateway_rows(args, upstreams, f"sqlite:///{tmp}/bench-gw.db")
        print("\nLatency per chat completion (ms): direct to the fake upstream vs through the gateway")
        print(table(["store", "agents", "model ms", "calls", "p50 dir", "p50 gw", "added", "p99 dir", "p99 gw",
                     "added", "gw CPU ms/call"], rows))
        print("\nStore throughput (model_request events, in process)")
        print(table(["store", "events", "appends/s", "reads/s"], store_rows(args.events, tmp)))


if __name__ == "__main__":
    main()
