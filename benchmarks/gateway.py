"""The gateway hop and the store, side by side with Agent Lightning 1.0.2's server, in one run.

    python benchmarks/gateway.py [--agents 1,8,64,256] [--delay 0.005] [--seconds 3] [--no-agl] [--no-floor]
                                 [--rounds 4] [--pairs N] [--events 5000] [--postgres auto]

Processes as in a real run, all on loopback:
- a fake OpenAI upstream: a minimal asyncio HTTP/1.1 server (uvloop when installed) answering
  every POST after `--delay` seconds of "model time" with one canned vLLM-shaped chat
  completion (600 prompt ids, 64 response ids with logprobs), so the upstream costs little CPU;
- the servers under test: `agl-lab serve` with the memory store and with the SQLite store (and
  with the PostgreSQL store given `--postgres URL|auto`),
  and (when `agentlightning` is importable) AGL's own `create_app` under uvicorn with its
  entry point's settings — each process idle while another is measured;
- three floors (this script's `--serve-floor`), for what the hop costs at the least: `floor`,
  hand-written on uvloop + httptools, forwards the bytes over one keep-alive connection;
  `floor+json`, the same, also does the JSON work no recording gateway can skip (parse the
  request, rewrite and re-encode it, parse the answer, encode one event with both);
  `uvicorn+json` does that work in a bare ASGI app served the way `agl-lab serve` serves
  (uvicorn with agl_lab's HTTP protocol, agl_lab's raw upstream client). None checks, retries
  or stores;
- this script's agents: asyncio tasks, each with its own rollout, sharing one aiohttp session per
  server.

Per agent count, each phase in 4 rounds with the servers taking turns (a drift of the
machine's load lands on every row alike; each server keeps its agents' connections across them):
1. **latency**: each agent alternates a direct call to the upstream and a call through the
   gateway (same ~1 KB body), so both see the same load; added = gateway − direct percentile
   (agents start staggered over one model time, as real agents do not call in lock-step; 400
   pairs at one agent, at least 1,600 of each kind above);
2. **throughput**: every agent calls through the gateway back to back for `--seconds` in all;
   proxied calls/s and those calls' latency ("busy", model time included: once the machine
   saturates, agents / calls/s, so compare it where the "added" figures of step 1 — a
   difference of two loaded percentiles — get noisy), and meanwhile a probe process GETs
   /healthz every 20 ms (its p99 says whether anything blocks the server's event loop; in a
   process of its own, so that it does not queue behind the agents' work in this one, started
   before the agents and stopped with them, so every probe falls inside the load);
3. the gateway process's user+system CPU per proxied call (/proc), the figure least sensitive
   to the machine's load.

Then in process: `Store.append_event` rate on each store (model_request-sized payloads), and
the cost of a terminal-cursor poll with 10 000 terminal rollouts in the store (the caught-up
poll a rollout manager makes every tick, and a full 1000-item page).

Without `agentlightning` the AGL ratio columns use the figures of issue #17 (quiet machine,
2026-11-30), labelled as such.

Timings depend on the machine and its load (printed with `os.getloadavg()` next to each
table): compare rows of one run — the ratio columns — not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
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

from agl_lab.server.backends import open_store  # noqa: E402
from agl_lab.server.gateway import proxy_base_url  # noqa: E402

MODEL = "bench-model"
KEY = "bench-key"
MESSAGES = [{"role": "system", "content": "You are a careful math assistant. " * 4}] + [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "step by step " * 12} for i in range(6)
]
# the body the gateway forwards in train mode, so the upstream does the same work either way
BODY = {"model": MODEL, "messages": MESSAGES, "temperature": 1.0, "return_token_ids": True, "logprobs": True}

FLOORS = {"floor": "bytes", "floor+json": "json", "uvicorn+json": "uvicorn"}  # rows of the floor servers

AGL_SERVER = """
import sys, uvicorn
from agentlightning.server.app import create_app
cfg = {"host": "127.0.0.1", "port": int(sys.argv[1]), "key": sys.argv[2],
       "default_proxy": {"model_name": sys.argv[3], "include_log_probs": True, "include_routed_experts": False,
                         "train": {"temperature": 1.0}, "val": {"temperature": 0.7}}}
uvicorn.run(create_app(cfg), host="127.0.0.1", port=cfg["port"], workers=1, timeout_keep_alive=120,
            log_level="warning")
"""


# ---------------------------------------------------------------------------------------------
# The fake upstream: canned answer after `delay` seconds
# ---------------------------------------------------------------------------------------------


def canned_completion() -> bytes:
    import json

    content = [{"token": f"t{k}", "logprob": -0.01 * (k + 1), "bytes": [116], "top_logprobs": []} for k in range(64)]
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "prompt_token_ids": list(range(1000, 1600)),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok " * 32},
                "token_ids": list(range(2000, 2064)),
                "logprobs": {"content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 600, "completion_tokens": 64, "total_tokens": 664},
    }
    payload = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
        "connection: keep-alive\r\n\r\n"
    ).encode()
    return head + payload


async def serve_upstream(port: int, delay: float) -> None:
    answer = canned_completion()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                if delay:
                    await asyncio.sleep(delay)
                writer.write(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------------------------------------
# The floor: the least a recording gateway can do, hand-written on uvloop + httptools
# ---------------------------------------------------------------------------------------------


class _FloorUpstream(asyncio.Protocol):
    """One keep-alive connection to the upstream; `answer` is the future of the request in flight."""

    def __init__(self) -> None:
        import httptools

        self.parser, self.chunks, self.answer = httptools.HttpResponseParser(self), [], None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        body, self.chunks = b"".join(self.chunks), []
        self.answer.set_result(body)


class _FloorServer(asyncio.Protocol):
    """Answers GET /healthz; forwards every POST to the upstream, and with `record` does the JSON
    work a recording gateway cannot skip: parse the request, rewrite and re-encode it, parse the
    answer, encode one event holding both (kept in a list). No checks, no retries, no ASGI."""

    def __init__(self, upstream_port: int, record: bool, pool: list, log: list):
        import httptools

        self.parser, self.url, self.chunks = httptools.HttpRequestParser(self), b"", []
        self.upstream_port, self.record, self.pool, self.log = upstream_port, record, pool, log

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        url, body, self.url, self.chunks = self.url, b"".join(self.chunks), b"", []
        if url.startswith(b"/proxy/"):
            asyncio.ensure_future(self.forward(body))
        else:
            self.answer(b'{"status":"ok"}')

    async def forward(self, body: bytes) -> None:
        loop = asyncio.get_running_loop()
        if self.record:
            request, body = rewritten(body)
        upstream = (
            self.pool.pop()
            if self.pool
            else (await loop.create_connection(_FloorUpstream, "127.0.0.1", self.upstream_port))[1]
        )
        upstream.answer = loop.create_future()
        upstream.transport.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: floor\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        answer = await upstream.answer
        self.pool.append(upstream)
        if self.record:
            self.log.append(event_of(request, answer))
        self.answer(answer)

    def answer(self, body: bytes) -> None:
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )


def rewritten(body: bytes) -> tuple[dict, bytes]:
    """The request JSON work of `floor+json` and `uvicorn+json`: parse, rewrite for train mode, re-encode."""
    import orjson

    request = {**orjson.loads(body), "model": MODEL, "temperature": 1.0, "return_token_ids": True, "logprobs": True}
    return request, orjson.dumps(request)


def event_of(request: dict, answer: bytes) -> bytes:
    """The answer's JSON work of `floor+json` and `uvicorn+json`: parse it, encode one event with both."""
    import orjson

    return orjson.dumps({"request": request, "response": orjson.loads(answer), "status": 200})


async def serve_floor(port: int, upstream_port: int, record: bool) -> None:
    pool: list = []
    log: list = []
    server = await asyncio.get_running_loop().create_server(
        lambda: _FloorServer(upstream_port, record, pool, log), "127.0.0.1", port, backlog=4096
    )
    async with server:
        await server.serve_forever()


def serve_uvicorn_floor(port: int, upstream_port: int) -> None:
    """`uvicorn+json`: `floor+json`'s work as a bare ASGI app, served by uvicorn the way `agl-lab serve`
    serves (agl_lab's HTTP protocol, uvloop) and forwarding through agl_lab's raw upstream client —
    what any recording gateway served by uvicorn costs at the least. No checks, retries or store."""
    import uvicorn

    from agl_lab.server.asgi import HTTP_PROTOCOL
    from agl_lab.server.upstream import RawUpstream

    client, log, url = RawUpstream(), [], f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if scope["path"].startswith("/proxy/"):
            request, body = rewritten(b"".join(chunks))
            answer = (await client.post_json(url, body)).content
            log.append(event_of(request, answer))
        else:
            answer = b'{"status":"ok"}'
        headers = [*start["headers"], (b"content-length", b"%d" % len(answer))]
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        http=HTTP_PROTOCOL,
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=120,
    )


def run_loop(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(args_of, ready_url_of, tries: int = 3) -> Iterator[tuple[str, int]]:
    """Start `python args_of(port)`; yield (base url, pid) once `ready_url_of(port)` answers."""
    for attempt in range(tries):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, *args_of(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        if _wait_ready(proc, ready_url_of(port)):
            break
        proc.kill()
        proc.wait(10)
        if attempt == tries - 1:
            raise RuntimeError(f"{args_of(port)} did not start: {proc.stderr.read().decode()[-2000:]}")
    try:
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_ready(proc: subprocess.Popen, url: str) -> bool:
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            r = (
                httpx.post(url, json={}, trust_env=False)
                if url.endswith("completions")
                else httpx.get(url, trust_env=False)
            )
            if r.status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


# ---------------------------------------------------------------------------------------------
# Agents
# ---------------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


async def latency_phase(session, direct: str, gateways: list[str], calls: int, stagger: float):
    """Each agent alternates direct / gateway calls -> (direct ms, gateway ms)."""
    import orjson

    payload = orjson.dumps(BODY)
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    d_ms: list[float] = []
    g_ms: list[float] = []

    async def call(url: str, out: list[float] | None) -> None:
        t0 = time.perf_counter()
        async with session.post(url, data=payload, headers=headers) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url} answered {r.status}: {(await r.text())[:300]}")
        if out is not None:
            out.append((time.perf_counter() - t0) * 1000)

    async def agent(i: int, gw: str, k: int, record: bool) -> None:
        await asyncio.sleep(stagger * i / len(gateways) if record else 0)
        for j in range(k):
            pair = [(direct, d_ms if record else None), (gw + "/chat/completions", g_ms if record else None)]
            for url, out in pair if (i + j) % 2 == 0 else pair[::-1]:
                await call(url, out)

    await asyncio.gather(*(agent(i, gw, 2, False) for i, gw in enumerate(gateways)))  # warm-up
    await asyncio.gather(*(agent(i, gw, calls, True) for i, gw in enumerate(gateways)))
    return d_ms, g_ms


async def throughput_phase(session, base: str, gateways: list[str], seconds: float):
    """Back-to-back proxied calls for `seconds` + a /healthz probe -> (calls, seconds, call ms, healthz ms)."""
    import orjson

    payload = orjson.dumps(BODY)
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    call_ms: list[float] = []

    # the probe runs in its own process (in this one it would queue behind the agents' own work);
    # the agents start once it has started up and it stops when they stop, so every probe falls
    # inside the load
    probe = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--probe",
        base + "/healthz",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert (await probe.stdout.readline()).strip() == b"ready"
    stop = time.perf_counter() + seconds

    async def agent(gw: str) -> None:
        while (t0 := time.perf_counter()) < stop:
            async with session.post(gw + "/chat/completions", data=payload, headers=headers) as r:
                await r.read()
            call_ms.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(agent(gw) for gw in gateways))
    elapsed = time.perf_counter() - t0
    probe.stdin.close()
    out, _ = await probe.communicate()
    return len(call_ms), elapsed, call_ms, [float(x) for x in out.split()]


def probe_health(url: str) -> None:
    """--probe: print "ready", then GET `url` every 20 ms until stdin closes; then print the
    latencies (ms), one per line."""
    import threading

    stopped = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stopped.set()), daemon=True).start()
    out = []
    with httpx.Client(trust_env=False, timeout=30) as client:
        client.get(url)  # connected and warm before the load starts
        print("ready", flush=True)
        while not stopped.is_set():
            t0 = time.perf_counter()
            client.get(url)
            out.append((time.perf_counter() - t0) * 1000)
            stopped.wait(0.02)
    print("\n".join(f"{x:.3f}" for x in out))


ROUNDS = 4  # each phase runs in this many rounds by default, the servers taking turns (see measure)


def latency_calls(agents: int, pairs: int | None, rounds: int) -> int:
    """Pairs per agent in the latency phase: `pairs` if given, else 400 at one agent and
    ≥ 1,600 samples of each kind above (at least 2 per round)."""
    if pairs is not None:
        return pairs
    return 400 if agents == 1 else max(2 * rounds, 1600 // agents)


async def measure(
    started: dict[str, tuple[str, int]], direct: str, rollout_ids: list[str], agents: int, args
) -> dict[str, dict]:
    """Both phases on every server at one agent count -> {server: row}.

    Each phase runs in `args.rounds` rounds with the servers taking turns, so that a drift of the
    machine's load (another process, the kernel writing back a file) lands on all of them alike
    rather than on whichever ran at the time; a round's samples join its server's. Every server
    keeps one client session (its agents' keep-alive connections) across the rounds.
    """
    import aiohttp

    rounds = args.rounds
    calls = -(-latency_calls(agents, args.pairs, rounds) // rounds)  # per round, rounded up
    gateways = {name: [proxy_base_url(base, r) for r in rollout_ids[:agents]] for name, (base, _) in started.items()}
    lat: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in started}
    busy: dict[str, list[float]] = {name: [] for name in started}
    health: dict[str, list[float]] = {name: [] for name in started}
    done = {name: [0, 0.0, 0.0] for name in started}  # calls, seconds, CPU seconds of the throughput phase
    loads: dict[str, str] = {}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {
            name: await stack.enter_async_context(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
            for name in started
        }
        for _ in range(rounds):
            for name in started:
                d_ms, g_ms = await latency_phase(
                    sessions[name], direct + "/v1/chat/completions", gateways[name], calls, args.delay
                )
                lat[name][0].extend(d_ms)
                lat[name][1].extend(g_ms)
        for _ in range(rounds):
            for name, (base, pid) in started.items():
                cpu0 = cpu_seconds(pid)
                n, seconds, call_ms, probe_ms = await throughput_phase(
                    sessions[name], base, gateways[name], args.seconds / rounds
                )
                done[name][0] += n
                done[name][1] += seconds
                done[name][2] += cpu_seconds(pid) - cpu0
                busy[name].extend(call_ms)
                health[name].extend(probe_ms)
                loads[name] = load()
    rows = {}
    for name in started:
        (d_ms, g_ms), (n, seconds, cpu) = lat[name], done[name]
        rows[name] = {
            "d50": pct(d_ms, 50),
            "d99": pct(d_ms, 99),
            "g50": pct(g_ms, 50),
            "g99": pct(g_ms, 99),
            "rate": n / seconds,
            "b50": pct(busy[name], 50),
            "b99": pct(busy[name], 99),
            "h50": pct(health[name], 50),
            "h99": pct(health[name], 99),
            "cpu": cpu * 1000 / max(1, n),
            "load": loads[name],
        }
    return rows


def setup_server(base: str, upstream: str, rollout_ids: list[str]) -> None:
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, trust_env=False) as admin:
        admin.post("/api/rollouts", json=[{"rollout_id": r, "input": {}} for r in rollout_ids]).raise_for_status()
        admin.post("/api/models", json=[{"model": MODEL, "endpoint": upstream + "/v1"}]).raise_for_status()


# ---------------------------------------------------------------------------------------------
# Store: appends/s and terminal-cursor polls
# ---------------------------------------------------------------------------------------------


def store_rows(n_events: int, tmp: str, postgres: str | None = None) -> list[list[str]]:
    from agl_lab.protocol import RolloutCreate, RolloutStatusPatch

    data = {
        "model": MODEL,
        "model_version": 0,
        "request": BODY,
        "response": {
            "prompt_token_ids": list(range(600)),
            "choices": [{"token_ids": list(range(64)), "logprobs": {"content": [{"logprob": -0.1}] * 64}}],
        },
        "server": {"model": MODEL, "endpoint": "http://x/v1", "version": 0},
        "latency_ms": 1.0,
        "http_status": 200,
        "status": "ok",
        "retry_count": 0,
        "usage": None,
        "finish_reason": "stop",
    }
    rows = []
    for url in ("memory", f"sqlite:///{tmp}/bench-store.db", *([postgres] if postgres else [])):
        store = open_store(url)
        store.create_rollouts([RolloutCreate(rollout_id=f"s{i}", input={}) for i in range(32)])
        t0 = time.perf_counter()
        for i in range(n_events):
            store.append_event(f"s{i % 32}", "0", "model_request", data)
        append_rate = n_events / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        n_read = sum(len(store.events(f"s{i}")) for i in range(32))
        read_rate = n_read / (time.perf_counter() - t0)
        # 10k terminal rollouts, then the polls a rollout manager makes
        ids = [f"t{i}" for i in range(10_000)]
        store.create_rollouts([RolloutCreate(rollout_id=r, input={"id": r}) for r in ids])
        for r in ids:
            store.patch_status(r, RolloutStatusPatch(state="running"))
            store.patch_status(r, RolloutStatusPatch(state="succeeded"))
        total = store.terminal_page(0, 1).total_terminal
        t0 = time.perf_counter()
        for _ in range(200):
            store.terminal_page(total, 1000)
        caught_up_us = (time.perf_counter() - t0) / 200 * 1e6
        t0 = time.perf_counter()
        for _ in range(5):
            page = store.terminal_page(total - 1000, 1000)
        page_ms = (time.perf_counter() - t0) / 5 * 1000
        assert len(page.items) == 1000
        store.close()
        rows.append(
            [
                url.split(":")[0],
                str(n_events),
                f"{append_rate:,.0f}",
                f"{read_rate:,.0f}",
                f"{caught_up_us:,.0f}",
                f"{page_ms:.1f}",
                load(),
            ]
        )
    return rows


@contextlib.contextmanager
def postgres_urls(given: str | None) -> Iterator[list[str]]:
    """--postgres: [] without it; 'auto': two fresh databases on a throwaway server; else the two URLs."""
    if not given:
        yield []
    elif given != "auto":
        urls = given.split(",")
        yield urls if len(urls) == 2 else urls * 2
    else:
        from tests.postgres import PostgresCluster

        cluster = PostgresCluster.start()
        try:
            yield [cluster.create_database(), cluster.create_database()]
        finally:
            cluster.stop()


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [" | ".join(h.rjust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", default="1,8,64,256", help="comma-separated agent counts")
    p.add_argument("--delay", type=float, default=0.005, help="upstream model time per call (s)")
    p.add_argument("--seconds", type=float, default=3.0, help="throughput phase per server and agent count")
    p.add_argument("--events", type=int, default=5000, help="event appends per store in the store table")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="rounds per phase, the servers taking turns")
    p.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="direct/gateway pairs per agent in the latency phase (default: 400 at one agent, "
        "≥ 1,600 samples above; a small number only checks that the script runs)",
    )
    p.add_argument("--no-agl", action="store_true", help="skip AGL even when importable")
    p.add_argument(
        "--postgres",
        default=None,
        metavar="URL|auto",
        help="also measure the PostgreSQL store: two empty databases' URLs, comma-separated (the "
        "server's, the store table's), or 'auto' to start a throwaway PostgreSQL (tests/postgres.py)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the three floor servers")
    p.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--serve-floor", nargs=3, default=None, help=argparse.SUPPRESS
    )  # PORT UPSTREAM_PORT bytes|json|uvicorn
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe is not None:
        probe_health(args.probe)
        return
    if args.serve_upstream is not None:
        run_loop(serve_upstream(args.serve_upstream, args.delay))
        return
    if args.serve_floor is not None:
        port, upstream_port, kind = args.serve_floor
        if kind == "uvicorn":
            serve_uvicorn_floor(int(port), int(upstream_port))
        else:
            run_loop(serve_floor(int(port), int(upstream_port), kind == "json"))
        return
    counts = [int(x) for x in args.agents.split(",")]
    use_agl = importlib.util.find_spec("agentlightning") is not None and not args.no_agl
    print(
        f"cpus={os.cpu_count()} load={load()} agents={counts} model time={args.delay * 1000:.0f} ms "
        f"throughput phase={args.seconds:.0f} s; AGL {'measured' if use_agl else 'not importable: skipped'}"
    )
    rollout_ids = [f"bench-{i}" for i in range(max(counts))]
    results: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as tmp, postgres_urls(args.postgres) as pg_urls:

        def upstream_args(port):
            return ["benchmarks/gateway.py", "--serve-upstream", str(port), "--delay", str(args.delay)]

        def ours(store):
            def command(port):
                return [
                    "-m",
                    "agl_lab.cli",
                    "serve",
                    "--port",
                    str(port),
                    "--key",
                    KEY,
                    "--model-name",
                    MODEL,
                    "--store",
                    store,
                    "--log-level",
                    "warning",
                ]

            return command

        servers = {"memory": ours("memory"), "sqlite": ours(f"sqlite:///{tmp}/bench-gw.db")}
        if pg_urls:
            servers["postgresql"] = ours(pg_urls[0])
        if use_agl:
            servers["AGL"] = lambda port: ["-c", AGL_SERVER, str(port), KEY, MODEL]
        health = lambda port: f"http://127.0.0.1:{port}/healthz"  # noqa: E731
        with (
            process(upstream_args, lambda port: f"http://127.0.0.1:{port}/v1/chat/completions") as (upstream, _),
            contextlib.ExitStack() as stack,
        ):
            if not args.no_floor:  # the floors get the upstream's port on their command line
                up_port = upstream.rsplit(":", 1)[1]
                for name, kind in FLOORS.items():
                    servers[name] = lambda port, kind=kind: [
                        "benchmarks/gateway.py",
                        "--serve-floor",
                        str(port),
                        up_port,
                        kind,
                    ]
            started = {name: stack.enter_context(process(cmd, health)) for name, cmd in servers.items()}
            for name, (base, _pid) in started.items():
                if name not in FLOORS:
                    setup_server(base, upstream, rollout_ids)
            for agents in counts:  # servers side by side per agent count: the same machine load
                for name, row in asyncio.run(measure(started, upstream, rollout_ids, agents, args)).items():
                    results[name, agents] = row
        print_gateway(results, counts, list(servers), use_agl)
        print(f"\nStore (in process; 10k terminal rollouts for the polls)  load={load()}")
        print(
            table(
                ["store", "events", "appends/s", "reads/s", "caught-up poll µs", "1000-item page ms", "load"],
                store_rows(args.events, tmp, pg_urls[1] if pg_urls else None),
            )
        )


# Issue #17's figures for AGL 1.0.2's server (quiet machine, 2026-11-30): added p50/p99 in ms at
# 1 and 8 agents, and its ceiling, ~130-200 calls/s (compared at 256 agents, where it saturates).
# Used when agentlightning is not importable.
AGL_FIGURES = {1: {"g50": 3.46, "g99": 23.6}, 8: {"g50": 7.78, "g99": 47.1}}
AGL_CEILING = 200.0  # calls/s, the top of the 130-200 range: the conservative ratio


def agl_reference(results: dict, counts: list[int], use_agl: bool) -> dict[int, dict]:
    """Per agent count, AGL's added p50/p99 (`g50`, `g99`, direct subtracted) and calls/s: measured
    in this run, or else issue #17's figures (NaN where it gives none)."""
    if use_agl:
        return {
            n: {
                "g50": results["AGL", n]["g50"] - results["AGL", n]["d50"],
                "g99": results["AGL", n]["g99"] - results["AGL", n]["d99"],
                "rate": results["AGL", n]["rate"],
            }
            for n in counts
        }
    nan = float("nan")
    return {
        n: {**AGL_FIGURES.get(n, {"g50": nan, "g99": nan}), "rate": AGL_CEILING if n >= 256 else nan} for n in counts
    }


def print_gateway(results: dict, counts: list[int], names: list[str], use_agl: bool) -> None:
    print(
        f"\nGateway: {counts} agents, ms; added = gateway − direct percentile; calls/s with agents calling "
        "back to back, busy p50/p99 their calls' latency (model time included), /healthz probed every 20 ms "
        "during it"
    )
    header = [
        "server",
        "agents",
        "p50 dir",
        "p50 gw",
        "+p50",
        "p99 dir",
        "p99 gw",
        "+p99",
        "calls/s",
        "busy p50",
        "busy p99",
        "healthz p50",
        "healthz p99",
        "CPU ms/call",
        "load",
    ]
    header += ["+p50 / AGL", "+p99 / AGL", "calls/s × AGL"]
    agl = agl_reference(results, counts, use_agl)
    ratio = lambda x, y: f"{x / y:.2f}" if y > 0 else "n/a"  # noqa: E731  (NaN > 0 is False)
    rows = []
    for agents in counts:
        for name in names:
            r = results[name, agents]
            row = [
                name,
                str(agents),
                f"{r['d50']:.2f}",
                f"{r['g50']:.2f}",
                f"{r['g50'] - r['d50']:+.2f}",
                f"{r['d99']:.2f}",
                f"{r['g99']:.2f}",
                f"{r['g99'] - r['d99']:+.2f}",
                f"{r['rate']:,.0f}",
                f"{r['b50']:.1f}",
                f"{r['b99']:.1f}",
                f"{r['h50']:.1f}",
                f"{r['h99']:.1f}",
                f"{r['cpu']:.2f}",
                r["load"],
            ]
            a = agl[agents]
            row += [
                ratio(r["g50"] - r["d50"], a["g50"]),
                ratio(r["g99"] - r["d99"], a["g99"]),
                ratio(r["rate"], a["rate"]),
            ]
            rows.append(row)
    if not use_agl:
        given = ", ".join(f"+{f['g50']} / +{f['g99']} at {n} agent{'s' * (n > 1)}" for n, f in AGL_FIGURES.items())
        print(
            f"AGL columns: issue #17's figures (agentlightning not importable), not measured in this run: added "
            f"p50 / p99 ms {given} (n/a at other counts), ceiling ~130-200 calls/s (calls/s at 256 agents "
            f"against {AGL_CEILING:.0f})"
        )
    print(table(header, rows))


if __name__ == "__main__":
    main()
