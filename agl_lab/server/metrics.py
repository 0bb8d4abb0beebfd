"""`GET /metrics`: the server's counters in the Prometheus text format (a leaf of `server/`).

    metrics = ServerMetrics()
    store = TimedStore(store, metrics)       every store call timed; claims, re-runs, expiries counted
    render(metrics.samples() + gauges)       -> the exposition text (`text/plain; version=0.0.4`)

The names (documented in docs/many-machines.md) are what one server process did since it
started; with several servers on one ledger, sum them over servers. Queue depth is a gauge read
from the store at scrape time (capped at `QUEUE_DEPTH_CAP`: a scrape must stay cheap).

| name | type | what |
|---|---|---|
| `agl_claims_total` | counter | claim requests answered |
| `agl_claimed_rollouts_total` | counter | rollouts handed out by claims |
| `agl_reruns_total` | counter | of those, attempts after the first (`last_attempt_id` > 0) |
| `agl_lease_expiries_total{outcome}` | counter | running rollouts whose lease ran out: `requeued` or `failed` |
| `agl_released_rollouts_total` | counter | rollouts a stopping runner gave back |
| `agl_store_seconds{op}` | summary | store call latency: `_count` and `_sum` per store method |
| `agl_store_errors_total{op}` | counter | store calls that raised |
| `agl_queue_depth` | gauge | rollouts queuing now (at most `QUEUE_DEPTH_CAP`) |
| `agl_inflight_calls` | gauge | proxied model calls in flight in this server's gateway |
| `agl_timeout_extensions_total` | counter | timed-out upstream attempts waited on again because the engine was working on the call (`Gateway.stats`) |
| `agl_aborted_past_cap_total` | counter | calls failed past `upstream_timeout_extensions`, their generation aborted |
| `agl_resent_unknown_total` | counter | timed-out attempts the engine did not know (never arrived, answered long ago, or still in transit): barred there, then sent again |
| `agl_runner_rollouts_total{outcome}` | counter | `agl-lab runner --metrics-port`: claimed, succeeded, failed, released, abandoned, conflicts |
| `agl_runner_running` | gauge | the runner's agents running now |

The text format is written here (it is small): `# HELP`, `# TYPE`, then `name{label="v"} value`
lines; label values escaped (`\\`, `"`, newline).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
QUEUE_DEPTH_CAP = 100_000

# name -> (type, help)
FAMILIES: dict[str, tuple[str, str]] = {
    "agl_claims_total": ("counter", "Claim requests answered."),
    "agl_claimed_rollouts_total": ("counter", "Rollouts handed out by claims."),
    "agl_reruns_total": ("counter", "Claimed rollouts on an attempt after the first (re-runs)."),
    "agl_lease_expiries_total": ("counter", "Running rollouts whose lease ran out, by outcome."),
    "agl_released_rollouts_total": ("counter", "Rollouts released back to the queue by stopping runners."),
    "agl_store_seconds": ("summary", "Store call latency in seconds, by store method."),
    "agl_store_errors_total": ("counter", "Store calls that raised, by store method."),
    "agl_queue_depth": ("gauge", "Rollouts queuing now (capped)."),
    "agl_inflight_calls": ("gauge", "Proxied model calls in flight in this server's gateway."),
    "agl_timeout_extensions_total": (
        "counter",
        "Timed-out upstream attempts waited on again because the engine was still working on the call.",
    ),
    "agl_aborted_past_cap_total": ("counter", "Proxied calls failed past upstream_timeout_extensions (aborted)."),
    "agl_resent_unknown_total": (
        "counter",
        "Timed-out upstream attempts the engine did not know: barred there, then sent again.",
    ),
    # agl-lab runner --metrics-port: one runner's `Runner.stats`
    "agl_runner_rollouts_total": ("counter", "Rollouts this runner handled, by outcome."),
    "agl_runner_running": ("gauge", "Agents this runner runs now."),
}


def runner_samples(stats: dict[str, int]) -> list[Sample]:
    """`Runner.stats` as samples: `agl_runner_rollouts_total{outcome}` and `agl_runner_running`."""
    out: list[Sample] = [
        ("agl_runner_rollouts_total", {"outcome": name}, float(value))
        for name, value in sorted(stats.items())
        if name != "running"
    ]
    return [*out, ("agl_runner_running", {}, float(stats.get("running", 0)))]


Sample = tuple[str, dict[str, str], float]  # (name with suffix, labels, value)


def gateway_samples(stats: dict[str, int]) -> list[Sample]:
    """`Gateway.stats` as samples. The gateway counts each extension once, there; this only reads it."""
    return [
        ("agl_timeout_extensions_total", {}, float(stats.get("timeout_extensions", 0))),
        ("agl_aborted_past_cap_total", {}, float(stats.get("aborted_past_cap", 0))),
        ("agl_resent_unknown_total", {}, float(stats.get("resent_unknown", 0))),
    ]


class ServerMetrics:
    """Thread-safe counters of one server process (store calls run in a thread pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        for name in (
            "agl_claims_total",
            "agl_claimed_rollouts_total",
            "agl_reruns_total",
            "agl_released_rollouts_total",
        ):
            self.counters[(name, ())] = 0.0  # present from the start: a scraper's rate() needs the zero
        self.store_count: dict[str, int] = defaultdict(int)
        self.store_sum: dict[str, float] = defaultdict(float)

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        with self._lock:
            self.counters[(name, tuple(sorted(labels.items())))] += value

    def observe_store(self, op: str, seconds: float) -> None:
        with self._lock:
            self.store_count[op] += 1
            self.store_sum[op] += seconds

    def samples(self) -> list[Sample]:
        """Every counter and summary now, as samples for `render`."""
        with self._lock:
            out: list[Sample] = [(name, dict(labels), value) for (name, labels), value in self.counters.items()]
            for op in sorted(self.store_count):
                out.append(("agl_store_seconds_count", {"op": op}, float(self.store_count[op])))
                out.append(("agl_store_seconds_sum", {"op": op}, self.store_sum[op]))
        return out


class TimedStore:
    """A Store that times each public method call (`agl_store_seconds{op}`) and counts what the
    claims, releases and lease sweeps return. Everything else is the wrapped store's."""

    def __init__(self, store: Any, metrics: ServerMetrics):
        self._store, self._metrics = store, metrics

    def __getattr__(self, name: str) -> Any:  # only for names not yet wrapped: the wrapper is kept
        attr = getattr(self._store, name)
        if name.startswith("_") or not callable(attr):
            return attr
        wrapped = self._timed(name)
        setattr(self, name, wrapped)  # later lookups find it on the instance (no __getattr__)
        return wrapped

    def _timed(self, name: str) -> Any:
        metrics, store = self._metrics, self._store

        counted = name in _COUNTED

        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = getattr(store, name)(*args, **kwargs)  # looked up per call: a patched method counts
            except BaseException:
                metrics.inc("agl_store_errors_total", op=name)
                raise
            finally:
                metrics.observe_store(name, time.perf_counter() - start)
            if counted:
                _count(metrics, name, result)
            return result

        call.__name__ = name
        return call

    def __repr__(self) -> str:
        return repr(self._store)


_COUNTED = frozenset({"claim_rollouts", "expire_leases", "release_rollouts"})


def _count(metrics: ServerMetrics, op: str, result: Any) -> None:
    if op == "claim_rollouts":
        metrics.inc("agl_claims_total")
        if result:
            metrics.inc("agl_claimed_rollouts_total", len(result))
            reruns = sum(1 for r in result if (r.status.last_attempt_id or "0") != "0")
            if reruns:
                metrics.inc("agl_reruns_total", reruns)
    elif op == "expire_leases":
        for outcome in result.values():
            metrics.inc("agl_lease_expiries_total", outcome=outcome)
    elif op == "release_rollouts" and result:
        metrics.inc("agl_released_rollouts_total", len(result))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render(samples: Iterable[Sample], families: dict[str, tuple[str, str]] = FAMILIES) -> str:
    """The Prometheus text exposition of `samples`, grouped by family, with HELP and TYPE."""
    by_family: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        name = sample[0]
        family = next((f for f in families if name == f or name in (f + "_count", f + "_sum")), name)
        by_family[family].append(sample)
    lines = []
    for family, rows in by_family.items():
        kind, text = families.get(family, ("untyped", family))
        lines += [f"# HELP {family} {text}", f"# TYPE {family} {kind}"]
        for name, labels, value in rows:
            label_text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
            lines.append(f"{name}{{{label_text}}} {_number(value)}" if labels else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"
