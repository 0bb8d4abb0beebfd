"""`engines.openmp`: a thread that stops computing gives its OpenMP pool back, and the engine does so.

Each check runs in a fresh Python (a clean process: its threads are the ones it made), counting the
process's threads (/proc/self/task) around torch's parallel ops. No timing here: the effect on a
decode step is measured in benchmarks/openmp_pools.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agl_lab.engines import openmp

pytestmark = pytest.mark.skipif(not openmp.available(), reason="torch here does not run on GNU OpenMP")

_PRELUDE = """
import json, os, threading, time
import torch
from agl_lab.engines import openmp
torch.set_num_threads(2)

def tasks():
    return set(os.listdir("/proc/self/task"))

def compute():  # an elementwise op and a product, each large enough to run on the thread's OpenMP pool
    torch.ones(1 << 22).mul_(2.0)
    x = torch.randn(512, 512)
    (x @ x).sum()

def settled(expected, before):  # a released worker ends a moment after the call returns
    deadline = time.time() + 10
    while len(tasks() - before) != expected and time.time() < deadline:
        time.sleep(0.05)
    return len(tasks() - before)
"""


def _run(body: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PRELUDE + body], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_release_frees_the_calling_thread_s_pool_and_its_next_op_makes_a_new_one():
    out = _run("""
base = tasks()
compute()
pool = len(tasks() - base)  # the main thread's worker (2 threads: itself and one more)
released = openmp.release_threads()
left = settled(0, base)
compute()
again = len(tasks() - base)
print(json.dumps({"pool": pool, "released": released, "left": left, "again": again}))
""")
    assert out == {"pool": 1, "released": True, "left": 0, "again": 1}


def test_the_engine_releases_the_decode_loop_s_pool_when_idle_and_the_trainer_s_at_resume():
    """The decode loop's pool goes when it runs out of work (`stats["thread_releases"]`); the caller's goes
    at `LocalEngine.resume` (a rollout phase begins), so one computing thread holds the only pool."""
    out = _run("""
from agl_lab.engines.local import LocalEngine
from agl_lab.engines.serving.scheduler import SamplingParams

engine = LocalEngine(device="cpu")
sched = engine.server.scheduler
sched.num_threads = 2
openmp.release_threads()  # building the engine computed on this thread: start from no pool here
time.sleep(0.5)
before = tasks()
fut = sched.submit(list(range(5, 60)), SamplingParams(max_tokens=4, seed=0, ignore_eos=True))
fut.result(timeout=120)
deadline = time.time() + 10
while sched.stats["thread_releases"] < 1 and time.time() < deadline:
    time.sleep(0.05)
loop_left = settled(0, before)  # the loop's worker is gone
compute()  # the trainer's thread computes: its own pool
trainer_pool = len(tasks() - before)
engine.resume()
trainer_left = settled(0, before)
engine.close()
print(json.dumps({"releases": sched.stats["thread_releases"], "loop_left": loop_left,
                  "trainer_pool": trainer_pool, "trainer_left": trainer_left}))
""")
    assert out["releases"] >= 1
    assert out == {**out, "loop_left": 0, "trainer_pool": 1, "trainer_left": 0}
