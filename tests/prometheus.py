"""The Prometheus text format of `GET /metrics`, parsed strictly for the tests.

samples = parse(resp.text)                          # {(name, frozenset(labels)): value}
value(samples, "agl_claims_total")                  # one sample; KeyError when it is absent
"""

from __future__ import annotations

import re

SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})? (\S+)')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text format -> {(name, labels): value}; fails on anything malformed."""
    assert text.endswith("\n")
    declared: dict[str, str] = {}
    samples: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ")
            assert kind in ("counter", "gauge", "summary", "histogram", "untyped"), line
            declared[family] = kind
            continue
        match = SAMPLE.fullmatch(line)
        assert match, f"malformed sample line: {line!r}"
        name, labels, value = match.groups()
        family = re.sub(r"_(count|sum)$", "", name) if name not in declared else name
        assert family in declared, f"{name} before its # TYPE line"
        key = (name, frozenset(LABEL.findall(labels or "")))
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = float(value)
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]
