"""Generated tokens/s of the local engine: dynamic batching vs one request at a time.

    python benchmarks/engine.py                      # tiny model, CPU, ~40 s
    python benchmarks/engine.py --max-tokens 64 --requests-per-client 4
    python benchmarks/engine.py --model-path "$(python -c 'from agl_lab.models import smollm2; print(smollm2())')" \
        --compare-url http://127.0.0.1:8000/v1     # SmolLM2-135M, side by side with e.g. vLLM (~6 min)

Each client is a thread with its own httpx client sending chat completions back to back
(`ignore_eos`, fixed `max_tokens`, so every request generates the same number of tokens).
Rows: 1, 8 and 32 concurrent clients with dynamic batching (max_batch_size=64), and 32
clients against a server that runs one request at a time (max_batch_size=1). The speed-up
column is tokens/s relative to one-at-a-time at 32 clients; "in forward" / "in step" are
the shares of wall time the scheduler spent in model forwards / in whole steps (forward +
sampling + batch bookkeeping) — the rest is HTTP, JSON and waiting for requests; "in prefill"
is the share in prompt forwards and "prompt cached" the share of prompt tokens the prefix
cache served (every chat prompt starts with the same system prompt).

`--model-path DIR` serves any HF model directory instead of the tiny model (the
one-at-a-time row is then left out: it would take minutes on a real model);
`--compare-url URL` runs the same clients against another OpenAI server (vLLM, say, serving
the same directory) in the same run and prints its tok/s beside ours.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import httpx

from agl_lab.engines.serving.openai_server import OpenAIServer
from agl_lab.engines.tiny import DEFAULT_MODEL_NAME, load_model_and_tokenizer


def run_clients(
    base_url: str, clients: int, requests_per_client: int, max_tokens: int, model: str = "agl-lab-tiny"
) -> tuple[int, float]:
    """→ (generated tokens, wall seconds) for `clients` threads × `requests_per_client` calls."""
    totals = [0] * clients
    errors: list[str] = []

    def client(i: int) -> None:
        with httpx.Client(base_url=base_url, timeout=300) as http:
            for r in range(requests_per_client):
                body = {
                    "model": model,
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "seed": 1000 * i + r,
                    "ignore_eos": True,
                    "logprobs": True,
                    "return_token_ids": True,
                    "messages": [{"role": "user", "content": f"client {i} request {r}: lookup the value of key {i}"}],
                }
                resp = http.post("/chat/completions", json=body)
                if resp.status_code != 200:
                    errors.append(resp.text)
                    return
                totals[i] += len(resp.json()["choices"][0]["token_ids"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return sum(totals), time.perf_counter() - t0


def measure(model, tokenizer, *, max_batch_size: int, clients: int, args: argparse.Namespace) -> dict:
    cache_mb = 0 if args.baseline else args.prefix_cache_mb
    with OpenAIServer(
        model,
        tokenizer,
        model_name=args.model_name,
        max_batch_size=max_batch_size,
        num_threads=args.num_threads,
        prefix_cache_mb=cache_mb,
    ) as server:
        server.scheduler.fast_decode = not args.baseline
        run_clients(server.base_url, min(clients, 4), 1, 8, args.model_name)  # warm-up (first forward, connections)
        s0 = dict(server.scheduler.stats)
        tokens, wall = run_clients(server.base_url, clients, args.requests_per_client, args.max_tokens, args.model_name)
        s1 = server.scheduler.stats
        steps = s1["steps"] - s0["steps"] + s1["prefills"] - s0["prefills"]
    return {
        "clients": clients,
        "max_batch_size": max_batch_size,
        "tokens": tokens,
        "seconds": wall,
        "tok_per_s": tokens / wall,
        "tokens_per_forward": tokens / max(steps, 1),
        "forward_share": (s1["forward_s"] - s0["forward_s"]) / wall,
        "step_share": (s1["step_s"] - s0["step_s"]) / wall,
        "prefill_share": (s1["prefill_s"] - s0["prefill_s"]) / wall,
        "cached_share": (s1["cached_tokens"] - s0["cached_tokens"])
        / max(1, s1["cached_tokens"] - s0["cached_tokens"] + s1["prefill_tokens"] - s0["prefill_tokens"]),
    }


def measure_remote(url: str, clients: int, args: argparse.Namespace) -> float:
    """tok/s of the same load against another OpenAI server (its first served model)."""
    name = httpx.get(f"{url.rstrip('/')}/models", timeout=30).json()["data"][0]["id"]
    run_clients(url, min(clients, 4), 1, 8, name)  # warm-up
    tokens, wall = run_clients(url, clients, args.requests_per_client, args.max_tokens, name)
    return tokens / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=6)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads of the decode loop")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="HF forward for decode steps and no prefix cache (the engine before #16)",
    )
    parser.add_argument("--prefix-cache-mb", type=float, default=256, help="0 turns the prefix cache off")
    parser.add_argument("--model-path", default=None, help="HF model directory (default: the tiny model)")
    parser.add_argument("--compare-url", default=None, help="another OpenAI server's /v1 URL to run side by side")
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer(args.model_path, device=args.device)
    args.model_name = Path(args.model_path).resolve().name if args.model_path else DEFAULT_MODEL_NAME

    rows = [measure(model, tokenizer, max_batch_size=64, clients=c, args=args) for c in args.clients]
    for r in rows:
        r["compare"] = measure_remote(args.compare_url, r["clients"], args) if args.compare_url else None
    if args.model_path is None:
        rows.append(measure(model, tokenizer, max_batch_size=1, clients=max(args.clients), args=args))
        rows[-1]["compare"] = None
    serial = rows[-1]["tok_per_s"] if args.model_path is None else None

    print(
        f"\nlocal engine{' (baseline: HF decode, no prefix cache)' if args.baseline else ''}, "
        f"{args.model_name} on {args.device} ({args.num_threads} decode thread(s)), "
        f"{args.max_tokens} tokens/request, {args.requests_per_client} requests/client, load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'clients':>8} {'batching':>14} {'tokens':>8} {'seconds':>8} {'tok/s':>9} {'tok/forward':>12} "
        f"{'in forward':>11} {'in prefill':>11} {'prompt cached':>14} {'in step':>8} {'vs 1-at-a-time':>15} "
        f"{'compare tok/s':>14}"
    )
    for r in rows:
        mode = "dynamic (64)" if r["max_batch_size"] > 1 else "one at a time"
        speedup = f"{r['tok_per_s'] / serial:.1f}x" if serial else "-"
        compare = f"{r['compare']:.1f}" if r["compare"] else "-"
        print(
            f"{r['clients']:>8} {mode:>14} {r['tokens']:>8} {r['seconds']:>8.2f} {r['tok_per_s']:>9.1f} "
            f"{r['tokens_per_forward']:>12.1f} {r['forward_share']:>10.0%} {r['prefill_share']:>10.0%} "
            f"{r['cached_share']:>13.0%} {r['step_share']:>8.0%} "
            f"{speedup:>15} {compare:>14}"
        )
    if args.compare_url:
        print(f"compare: {args.compare_url}")


if __name__ == "__main__":
    main()
