"""The prepared GPU check, in two tiers: one PASS/FAIL/SKIP line per check, non-zero exit on failure.

    scripts/gpu_smoke.sh --tier A            # a bare GPU machine: torch (CUDA build) + transformers
    scripts/gpu_smoke.sh --tier B            # the README's GPU environment (verl[vllm]==0.9.1 + agl_lab)
    python scripts/gpu_smoke.py --tier A --dry-run   # on any machine: says what each check would check
    python scripts/gpu_smoke.py --cpu-rehearsal      # A1, A4–A8 (A5, A8: their gates) on CPU: the script's code, not the GPU check

**Tier A** needs only torch with CUDA and transformers (Python 3.11 or 3.12; no verl, no vLLM, no
network: the tiny Qwen2 model is built in code from a config). It checks what the GPU path relies
on below verl:

| check            | what it runs                                                              | PASS when |
|------------------|---------------------------------------------------------------------------|-----------|
| A0 driver        | the NVIDIA driver (`nvidia-smi`) against torch's CUDA build (agl_lab/engines/verl/driver.py; SKIP without the checkout) | driver >= the build's minimum (13.x: 580, 12.x: 525) |
| A1 attention     | the tiny Qwen2 in bf16 with `sdpa` (and `flash_attention_2` when flash_attn is installed) against fp32 eager; packed rows (remove-padding) against padded | bf16 within 0.1 of fp32 (max abs logit), packed = padded to 1e-4 (fp32) |
| A2 cuda_ipc      | a CUDA tensor shared from one process to another (`torch.multiprocessing` reductions, what verl/vLLM's IPC weight transfer uses) | the receiver reads the sender's values, writes back visibly |
| A3 nccl          | an NCCL process group over min(2, GPUs) processes, all_reduce + broadcast | sums and copies exact (one GPU: one rank, said on the line) |
| A4 fsdp2_offload | one FSDP2 (`fully_shard`) step, bf16 mixed precision, `CPUOffloadPolicy(pin_memory=True)`, AdamW | finite loss, every parameter moved, loss lower after the step |
| A5 local_engine  | agl_lab's local engine: bf16 steps, served vs trained logprobs (needs the checkout + verl's learning core; SKIP without; with them, FAIL when requirements-gpu.txt's modules — psycopg, fastapi, … — are missing) | max |Δlogp| < 0.25, mean < 0.02 |
| A6 torch_compile | one `torch.compile`d op on the device (Triton on CUDA), after checking for a C compiler and `Python.h`: verl's `use_torch_compile` and vLLM's compile step need both | compiled = eager to 1e-5 |
| A7 batch_invariant | `engine_options.batch_invariant`'s forward (fp32 and bf16): one row alone vs among 7 companions, prefill + 3 decode steps (SKIP without the checkout) | bitwise equal, or the engine warns for that dtype/device (`fast_decode.invariance_gap`) |
| A8 overlap | `agl_lab.rollout.max_staleness=1`: 3 bf16 local-engine steps with generation overlapping the update (SKIP as A5) | `staleness/token_age_max` <= 1 every step |

**Tier B** needs the README's GPU environment (`pip install 'verl[vllm]==0.9.1'`, agl_lab with
requirements-gpu.txt, pytest) and this checkout:

| check            | what it runs                                                              |
|------------------|---------------------------------------------------------------------------|
| B1 startup_check | the verl engine's start-up check with vLLM's rows (`check_verl_api`) and the attention package rule for configs/gpu_verl.yaml |
| B2 model_load    | the actor loaded exactly as verl's FSDP worker loads it (`python -m agl_lab.engines.verl.model_load`) on the GPU |
| B3 config_tests  | `pytest tests/test_gpu_path.py tests/test_vllm_gpu_api.py tests/vllm/test_vllm_config.py` |
| B4 two_steps     | `agl-lab train configs/gpu_verl.yaml --steps 2` on the tiny model (verl FSDP2 workers + vLLM 0.24 replicas on Ray) |

Exit codes: 0 every check PASS/SKIP · 1 a check FAILed · 2 bad arguments · 3 no CUDA device (with a CUDA
build of torch, the line names the driver and the driver the build needs). Each check that runs a
subprocess has a timeout (`TIMEOUTS`); `gpu_smoke.sh` wraps a tier in `WRAPPER_TIMEOUT` seconds, more
than the sum of the tier's (tier A under 10 minutes).
Carry tier A to a bare machine as this checkout (~5 MiB without .git) or as this one file.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda"  # "cpu" under --cpu-rehearsal (A1 and A4 only: the script's own code, not the GPU check)


class Skip(Exception):
    """A check that cannot run here (its reason is printed on the SKIP line)."""


# ------------------------------------------------------------------------------------------
# Tier A: torch + transformers only
# ------------------------------------------------------------------------------------------


def tiny_qwen2(attn: str, dtype: Any, seed: int = 0) -> Any:
    """A 2-layer Qwen2 from a config (no download), on the GPU, with attention `attn`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(device=DEVICE, dtype=dtype).eval()


def _rows(lengths: tuple[int, ...] = (17, 40, 5, 29), vocab: int = 512) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (n,), generator=gen).to(DEVICE) for n in lengths]


def _padded_logits(model: Any, rows: list[Any]) -> Any:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return torch.cat([out[i, : len(r)] for i, r in enumerate(rows)]).float()


def _packed_logits(model: Any, rows: list[Any]) -> Any:
    import torch

    positions = torch.cat([torch.arange(len(r), device=DEVICE) for r in rows])[None]
    with torch.no_grad():
        return model(input_ids=torch.cat(rows)[None], position_ids=positions, use_cache=False).logits[0].float()


def check_attention() -> str:
    import torch

    rows = _rows()
    reference = tiny_qwen2("eager", torch.float32)
    expected = _padded_logits(reference, rows)
    impls = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
    details = []
    for attn in impls:
        model = tiny_qwen2(attn, torch.bfloat16)
        diff = (_padded_logits(model, rows) - expected).abs().max().item()
        packed = (_packed_logits(model, rows) - _padded_logits(model, rows)).abs().max().item()
        fp32 = tiny_qwen2(attn, torch.float32) if attn == "sdpa" else None
        exact = (_packed_logits(fp32, rows) - _padded_logits(fp32, rows)).abs().max().item() if fp32 else 0.0
        details.append(f"{attn}: bf16 vs fp32 {diff:.3g}, packed vs padded bf16 {packed:.3g} fp32 {exact:.2g}")
        if diff > 0.1 or exact > 1e-4 or packed > 0.1:
            raise AssertionError("; ".join(details))
    if len(impls) == 1:
        details.append("flash_attention_2 not checked (flash_attn not installed)")
    return "; ".join(details)


def _ipc_child(queue: Any, answer: Any) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    tensor = torch.arange(1024, dtype=torch.float32, device="cuda")
    rebuild, args = reduce_tensor(tensor)
    queue.put((rebuild, args))
    answer.get(timeout=120)  # keep the tensor alive until the parent has read and written it
    queue.put(float(tensor[0].item()))


def check_cuda_ipc() -> str:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, answer = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(queue, answer))
    child.start()
    try:
        rebuild, args = queue.get(timeout=120)
        shared = rebuild(*args)
        ok = torch.equal(shared, torch.arange(1024, dtype=torch.float32, device="cuda"))
        shared[0] = -7.0
        torch.cuda.synchronize()
        answer.put("read")
        seen = queue.get(timeout=120)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    if not ok or seen != -7.0:
        raise AssertionError(f"values read {ok}, the sender saw the write: {seen}")
    return "a CUDA tensor shared across processes: read, and the write seen by the sender"


def _nccl_worker(rank: int, world: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.full((1024,), float(rank + 1), device="cuda")
        dist.all_reduce(x)
        y = torch.arange(8.0, device="cuda") if rank == 0 else torch.zeros(8, device="cuda")
        dist.broadcast(y, src=0)
        results.put((rank, float(x[0].item()), y.tolist()))
    finally:
        dist.destroy_process_group()


def check_nccl() -> str:
    import socket

    import torch
    import torch.multiprocessing as mp

    world = min(2, torch.cuda.device_count())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_nccl_worker, args=(r, world, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = [results.get(timeout=TIMEOUTS["A3"]) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    want = float(sum(range(1, world + 1)))
    bad = [g for g in got if g[1] != want or g[2] != [float(i) for i in range(8)]]
    if bad or any(p.exitcode for p in procs):
        raise AssertionError(f"results {got}, exit codes {[p.exitcode for p in procs]}")
    if world == 1:
        return (
            f"NCCL {torch.cuda.nccl.version()} with ONE rank (one GPU): the group starts, nothing crossed between GPUs"
        )
    return f"NCCL {torch.cuda.nccl.version()} over {world} ranks: all_reduce and broadcast exact"


def check_fsdp2_offload() -> str:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    with tempfile.TemporaryDirectory() as tmp:
        backend = "cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            if DEVICE == "cuda":
                torch.cuda.set_device(0)
            model = tiny_qwen2("sdpa", torch.float32).train()
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            offload = CPUOffloadPolicy(pin_memory=DEVICE == "cuda")  # pinning needs an accelerator
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=policy, offload_policy=offload)
            fully_shard(model, mp_policy=policy, offload_policy=offload)
            before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ids = torch.cat(_rows((64,)))[None]
            losses = []
            for _ in range(2):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                losses.append(float(loss.item()))
                loss.backward()
                optim.step()
                optim.zero_grad()
            moved = sum(not torch.equal(before[n], p.detach().full_tensor()) for n, p in model.named_parameters())
            device = {str(p.device) for p in model.parameters()}
        finally:
            dist.destroy_process_group()
    if not all(map(lambda v: v == v and abs(v) < 1e4, losses)) or moved != len(before) or losses[1] >= losses[0]:
        raise AssertionError(f"losses {losses}, {moved}/{len(before)} parameters moved")
    return f"loss {losses[0]:.4f} → {losses[1]:.4f}, {moved}/{len(before)} parameters moved, parameters on {device}"


def check_local_engine() -> str:
    sys.path.insert(0, str(ROOT))
    missing = [m for m in ("agl_lab", "verl", "ray", "tensordict", "omegaconf") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(
            f"agl_lab's local engine imports verl's learning core (DataProto, GRPO, the loss registry): "
            f"missing {missing} (tier B's environment has them)"
        )
    present = _gpu_requirements_present()
    if DEVICE != "cuda":  # the CPU rehearsal: the gate only, the bf16 steps need the GPU
        return f"{present}; the 3 bf16 steps need a GPU (not run)"
    import torch

    with tempfile.TemporaryDirectory(prefix="agl_lab_gpu_smoke_") as tmp:
        with _local_trainer("cuda", torch.bfloat16, 3, 150, Path(tmp)) as trainer:
            history = [trainer.step() for _ in range(3)]
    worst = max(m["training/rollout_logprobs_diff_max"] for m in history)
    mean = max(m["training/rollout_logprobs_diff_mean"] for m in history)
    if worst >= 0.25 or mean >= 0.02:
        raise AssertionError(f"bf16 served vs trained logprobs: max {worst:.3g} (< 0.25), mean {mean:.3g} (< 0.02)")
    return f"3 bf16 steps: served vs trained logprobs max {worst:.3g}, mean {mean:.3g}"


def _gpu_requirements_present() -> str:
    """requirements-gpu.txt's modules that a run imports late (the start-up check's table), psycopg too."""
    from agl_lab.engines.verl.api import POSTGRES_PACKAGES, SERVER_PACKAGES

    wanted = {**SERVER_PACKAGES, **POSTGRES_PACKAGES}
    absent = [package for module, package in wanted.items() if importlib.util.find_spec(module) is None]
    if absent:
        raise AssertionError(f"the GPU environment lacks {absent}: pip install -r requirements-gpu.txt")
    return f"requirements-gpu.txt's {len(wanted)} late-imported modules present ({', '.join(wanted)})"


def _checkout_driver() -> Any:
    """agl_lab/engines/verl/driver.py (stdlib only), or None when this file was carried alone."""
    path = ROOT / "agl_lab" / "engines" / "verl" / "driver.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("agl_lab_gpu_smoke_driver", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_driver() -> str:
    import torch

    driver = _checkout_driver()
    if driver is None:
        raise Skip("carried as one file: the driver rule lives in agl_lab/engines/verl/driver.py")
    found, cuda = driver.driver_version(), torch.version.cuda
    needed = driver.MIN_DRIVER.get(int(cuda.split(".")[0])) if cuda else None
    if found is None or needed is None:
        return f"torch {torch.__version__} (CUDA {cuda}); driver {found} (nothing to compare)"
    if int(found.split(".")[0]) < needed:  # a device is visible all the same: NVIDIA's forward-compatibility package
        return f"driver {found} < {needed} for CUDA {cuda}, yet a device is visible: forward compatibility in use?"
    return f"driver {found} >= {needed}, what torch {torch.__version__}'s CUDA {cuda} build needs"


def check_torch_compile() -> str:
    import shutil
    import sysconfig

    import torch

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = ([] if compiler else ["a C compiler (gcc)"]) + ([] if header.exists() else [f"{header} (python3.X-dev)"])
    if missing:
        raise AssertionError(
            f"missing {' and '.join(missing)}: torch.compile (verl's use_torch_compile, vLLM's compile step) builds "
            "C code at start-up; install them, or set actor_rollout_ref.actor.use_torch_compile=false and "
            "actor_rollout_ref.rollout.enforce_eager=true (docs/gpu.md)"
        )

    def op(x: Any) -> Any:
        return torch.nn.functional.gelu(x) * torch.sin(x) + x.square().mean(-1, keepdim=True)

    x = torch.randn(64, 256, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    compiled = torch.compile(op, fullgraph=True, dynamic=False)
    diff = (compiled(x) - op(x)).abs().max().item()
    if diff > 1e-5:
        raise AssertionError(f"compiled vs eager {diff:.3g}")
    backend = "Triton" if DEVICE == "cuda" else "C++"
    return f"torch.compile (inductor, {backend}) of one op on {DEVICE}: compiled = eager to {diff:.2g}; cc {compiler}"


def _row_alone_vs_batched(model: Any) -> float:
    """Max |Δ| of one row's logits (prefill + 3 decode steps) alone vs among 7 companions, invariant mode."""
    import torch

    from agl_lab.engines.serving.decode_batch import DecodeBatch

    target, *companions = (r.tolist() for r in _rows((37, 3, 50, 8, 120, 1, 64, 12)))

    def logits(prompts: list) -> Any:
        n, row = len(prompts), len(prompts) - 1
        batch, first = DecodeBatch.prefill(model, prompts, [1.0] * n, [1.0] * n, [False] * n, 3, invariant=True)
        out = [first[row].float().clone()]
        for t in range(3):
            batch.tokens = torch.full((n,), 7, device=DEVICE)
            batch.tokens[row] = 100 + t
            out.append(batch.decode(model, invariant=True)[row].float().clone())
        return torch.stack(out)

    with torch.inference_mode():
        return (logits([target]) - logits([*companions, target])).abs().max().item()


def check_batch_invariance() -> str:
    sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("agl_lab") is None:
        raise Skip("needs the agl_lab checkout (agl_lab.engines.serving)")
    import torch

    from agl_lab.engines.serving.fast_decode import invariance_gap

    found = []
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_qwen2("eager", dtype)
        diff, gap = _row_alone_vs_batched(model), invariance_gap(model)
        if diff > 0 and gap is None:
            raise AssertionError(
                f"{dtype}: a row alone vs batched differs by {diff:.3g}, yet the engine would not warn"
            )
        found.append(f"{str(dtype).removeprefix('torch.')} {'bitwise equal' if diff == 0 else f'max |Δ| {diff:.3g}'}")
    return (
        f"batch_invariant on {DEVICE}, a row alone vs among 7: {'; '.join(found)} (the engine warns where not promised)"
    )


def check_overlap() -> str:
    sys.path.insert(0, str(ROOT))
    missing = [m for m in ("agl_lab", "verl", "ray", "tensordict", "omegaconf") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"agl_lab's local engine imports verl's learning core: missing {missing}")
    if DEVICE != "cuda":
        return "the 3 overlapped bf16 steps need a GPU (not run)"
    import torch

    overrides = [  # benchmarks/overlap.py's stale1-wait case: carry-over collection on, two batches' worth
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=16",
        "agl_lab.rollout.max_staleness=1",
        "agl_lab.rollout.stale_groups=wait",
    ]
    with tempfile.TemporaryDirectory(prefix="agl_lab_gpu_smoke_") as tmp:
        with _local_trainer("cuda", torch.bfloat16, 3, 150, Path(tmp), overrides) as trainer:
            history = [trainer.step() for _ in range(3)]
    ages = [m.get("staleness/token_age_max") for m in history]
    if any(a is None for a in ages) or max(ages) > 1:
        raise AssertionError(f"staleness/token_age_max per step {ages}: absent or above the bound 1")
    worst = max(m["training/rollout_logprobs_diff_max"] for m in history)
    return f"3 bf16 steps, staleness ≤ 1: token age max per step {ages}, served vs trained logprobs max {worst:.3g}"


def _local_trainer(
    device: str, dtype: Any, steps: int, warm_start: int, run_dir: Path, overrides: tuple | list = ()
) -> Any:
    from agl_lab.config import load_config
    from agl_lab.trainer import Trainer

    cfg = load_config(
        ROOT / "configs" / "cpu_tiny.yaml",
        [
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "agl_lab.task.n_train=64",
            "agl_lab.task.n_val=0",
            "agl_lab.runner.concurrency=32",
            "agl_lab.rollout.wait_timeout_seconds=120",
            "agl_lab.wandb.mode=disabled",
            f"agl_lab.model.device={device}",
            f"agl_lab.model.warm_start_steps={warm_start}",
            f"trainer.total_training_steps={steps}",
            *overrides,
        ],
    )
    trainer = Trainer(cfg, run_dir=run_dir, console=False)
    with trainer.engine.weights_lock:  # the engine serves and trains this very module
        trainer.engine.model.to(dtype)
    return trainer


# ------------------------------------------------------------------------------------------
# Tier B: the README's GPU environment
# ------------------------------------------------------------------------------------------


def _tiny_model_dir() -> str:
    sys.path.insert(0, str(ROOT))
    from agl_lab.engines.tiny import tiny_model_dir

    return str(tiny_model_dir())


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def check_startup() -> str:
    sys.path.insert(0, str(ROOT))
    from agl_lab.config import load_config
    from agl_lab.engines.verl.api import check_attention, check_verl_api

    if importlib.util.find_spec("vllm") is None:
        raise AssertionError("vLLM is not installed: pip install 'verl[vllm]==0.9.1'")
    problems = check_verl_api(include_vllm=True) + check_attention(load_config(ROOT / "configs" / "gpu_verl.yaml"))
    if problems:
        raise AssertionError("; ".join(problems))
    import vllm

    return f"every VERL_API row matches the installed verl/vLLM {vllm.__version__}; attention package rule OK"


def check_model_load() -> str:
    out = _run(
        [
            sys.executable,
            "-m",
            "agl_lab.engines.verl.model_load",
            str(ROOT / "configs" / "gpu_verl.yaml"),
            f"agl_lab.model.path={_tiny_model_dir()}",
        ],
        timeout=TIMEOUTS["B2"],
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"ok": False, "error": out.stderr[-2000:]}
    if not result.get("ok") or result.get("packed_vs_padded_max_abs", 1) > 1e-4:
        raise AssertionError(json.dumps(result))
    return (
        f"{result['class']} {result['attn_implementation']} {result['dtype']} on {result['device']}, "
        f"packed vs padded {result['packed_vs_padded_max_abs']:.2g}"
    )


def check_config_tests() -> str:
    if importlib.util.find_spec("pytest") is None:
        raise AssertionError("pytest is not installed here: pip install pytest")
    out = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_gpu_path.py",
            "tests/test_vllm_gpu_api.py",
            "tests/vllm/test_vllm_config.py",
        ],
        timeout=TIMEOUTS["B3"],
    )
    tail = out.stdout.strip().splitlines()[-1:] or [out.stderr[-500:]]
    if out.returncode:
        raise AssertionError(out.stdout[-3000:])
    return tail[0]


def check_two_steps() -> str:
    with tempfile.TemporaryDirectory(prefix="agl_lab_gpu_b4_") as tmp:
        out = _run(
            [
                sys.executable,
                "-m",
                "agl_lab.cli",
                "train",
                "configs/gpu_verl.yaml",
                "--steps",
                "2",
                "--run-dir",
                tmp,
                f"agl_lab.model.path={_tiny_model_dir()}",
                "agl_lab.task.n_train=32",
                "agl_lab.task.n_val=0",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "data.max_prompt_length=512",
                "data.max_response_length=256",
                "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            ],
            timeout=TIMEOUTS["B4"],
        )
        metrics = Path(tmp) / "metrics.jsonl"
        steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    trained = [m for m in steps if "actor/pg_loss" in m]
    if out.returncode or len(trained) < 2:
        raise AssertionError(
            f"exit {out.returncode}, {len(trained)} steps trained:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        )
    diff = max(m.get("training/rollout_probs_diff_max", float("nan")) for m in trained)
    return (
        f"2 steps of gpu_verl.yaml (tiny model): pg_loss {trained[-1]['actor/pg_loss']:.4g}, "
        f"rollout_probs_diff_max {diff:.3g}"
    )


# ------------------------------------------------------------------------------------------
# Running the checks
# ------------------------------------------------------------------------------------------

#: seconds a check may run (its subprocesses' timeouts; in-process checks: what they are given by
#: the wrapper): a tier's sum stays under WRAPPER_TIMEOUT, which gpu_smoke.sh applies to the whole run
TIMEOUTS = {"A0": 30, "A1": 60, "A2": 40, "A3": 60, "A4": 60, "A5": 90, "A6": 60, "A7": 20, "A8": 90}
TIMEOUTS |= {"B1": 120, "B2": 240, "B3": 420, "B4": 540}
STARTUP_SECONDS = 60  # importing torch (and, in tier B, vLLM) before the first check
WRAPPER_TIMEOUT = {"A": 590, "B": 1440}  # tier A: under 10 minutes (a 10-minute call)


def wrapper_timeout(tiers: str) -> int:
    return sum(WRAPPER_TIMEOUT[t] for t in tiers)


Check = tuple[str, Callable[[], str], str]
TIERS: dict[str, list[Check]] = {
    "A": [
        (
            "A0 driver",
            check_driver,
            "the NVIDIA driver (nvidia-smi) against torch's CUDA build: >= 580 for CUDA 13, >= 525 for CUDA 12",
        ),
        (
            "A1 attention",
            check_attention,
            "tiny Qwen2: bf16 sdpa (and flash_attention_2 if installed) vs fp32 eager "
            "(< 0.1 max abs logit); packed rows = padded rows (fp32 < 1e-4)",
        ),
        (
            "A2 cuda_ipc",
            check_cuda_ipc,
            "a CUDA tensor shared to a second process (torch reductions): values read, a write seen by the sender",
        ),
        (
            "A3 nccl",
            check_nccl,
            "NCCL process group over min(2, GPUs) processes: all_reduce + broadcast exact (one GPU: one rank, said)",
        ),
        (
            "A4 fsdp2_offload",
            check_fsdp2_offload,
            "FSDP2 fully_shard, bf16 mixed precision, CPUOffloadPolicy(pinned), "
            "two AdamW steps: finite, every parameter moved, loss lower",
        ),
        (
            "A5 local_engine",
            check_local_engine,
            "agl_lab local engine, 3 bf16 steps: served vs trained logprobs "
            "max < 0.25, mean < 0.02 (SKIP without agl_lab + verl; FAIL without requirements-gpu.txt's psycopg, …)",
        ),
        (
            "A6 torch_compile",
            check_torch_compile,
            "a C compiler and Python.h present; one torch.compile'd op on the device (Triton) = eager to 1e-5",
        ),
        (
            "A7 batch_invariant",
            check_batch_invariance,
            "engine_options.batch_invariant's forward, fp32 and bf16: a row alone vs among 7 companions; "
            "where its bits differ the engine warns (fast_decode.invariance_gap) (SKIP without agl_lab)",
        ),
        (
            "A8 overlap",
            check_overlap,
            "agl_lab.rollout.max_staleness=1 on the local engine, 3 bf16 steps: staleness/token_age_max <= 1 "
            "(SKIP without agl_lab + verl)",
        ),
    ],
    "B": [
        (
            "B1 startup_check",
            check_startup,
            "check_verl_api(include_vllm=True) + the attention package rule for "
            "configs/gpu_verl.yaml: no problem listed",
        ),
        (
            "B2 model_load",
            check_model_load,
            "python -m agl_lab.engines.verl.model_load configs/gpu_verl.yaml on the "
            "GPU (tiny model): loads, packed = padded",
        ),
        (
            "B3 config_tests",
            check_config_tests,
            "pytest tests/test_gpu_path.py tests/test_vllm_gpu_api.py tests/vllm/test_vllm_config.py",
        ),
        (
            "B4 two_steps",
            check_two_steps,
            "agl-lab train configs/gpu_verl.yaml --steps 2 on the tiny model: two trained steps in metrics.jsonl",
        ),
    ],
}


REHEARSED = ("A1", "A4", "A5", "A6", "A7", "A8")  # --cpu-rehearsal: what runs on CPU (A5: its dependency gate only)


def cuda_problem() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed: install the CUDA build of torch that matches the driver (pytorch.org)"
    import torch

    if not torch.cuda.is_available():
        driver = _checkout_driver() if torch.version.cuda else None
        if driver is not None:  # a CUDA build: name the driver and what the build needs
            return driver.cuda_build_problem(torch.__version__, torch.version.cuda, driver.driver_version())
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA device visible to torch {torch.__version__} ({built})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", default="A", help="A, B or AB (default A)")
    parser.add_argument("--only", default=None, help="comma-separated check ids to run (e.g. A1,A3)")
    parser.add_argument("--dry-run", action="store_true", help="print what each check would check; run nothing")
    parser.add_argument(
        "--cpu-rehearsal",
        action="store_true",
        help="run A1, A4, A5's dependency gate and A6 on CPU (the script's own code; NOT the GPU check: "
        "always exits 1 on success)",
    )
    parser.add_argument(
        "--wrapper-timeout", action="store_true", help="print the seconds gpu_smoke.sh gives the tier(s); run nothing"
    )
    args = parser.parse_args(argv)
    tiers = [t for t in args.tier.upper() if t in TIERS]
    if not tiers or len(tiers) != len(args.tier):
        parser.error(f"--tier {args.tier!r}: use A, B or AB")
    if args.wrapper_timeout:
        print(wrapper_timeout("".join(tiers)))
        return 0
    only = {o.strip().upper() for o in args.only.split(",")} if args.only else None
    checks = [c for t in tiers for c in TIERS[t] if only is None or c[0].split()[0] in only]
    if args.dry_run:
        for name, _, what in checks:
            print(f"DRY  {name}: would check {what}", flush=True)
        print(f"gpu_smoke: dry run, {len(checks)} check(s) listed, none run (tier {args.tier.upper()})", flush=True)
        return 0
    if args.cpu_rehearsal:
        global DEVICE
        DEVICE = "cpu"
        checks = [c for c in checks if c[0].split()[0] in REHEARSED]
    problem = None if args.cpu_rehearsal else cuda_problem()
    if problem:
        print(f"FAIL gpu_smoke: {problem}", flush=True)
        return 3
    import torch

    where = "CPU rehearsal" if args.cpu_rehearsal else f"{torch.cuda.get_device_name(0)} ×{torch.cuda.device_count()}"
    print(
        f"gpu_smoke: {where} · torch {torch.__version__} (CUDA {torch.version.cuda}) · Python {sys.version.split()[0]}",
        flush=True,
    )
    failed = 0
    for name, fn, _ in checks:
        start = time.time()
        try:
            detail = fn()
            print(f"PASS {name}: {detail} ({time.time() - start:.1f} s)", flush=True)
        except Skip as exc:
            print(f"SKIP {name}: {exc}", flush=True)
        except Exception as exc:  # noqa: BLE001 (one line per check; the traceback after it)
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc} ({time.time() - start:.1f} s)", flush=True)
            traceback.print_exc(limit=4)
    print(f"gpu_smoke: {'FAIL' if failed else 'PASS'} ({failed} of {len(checks)} failed)", flush=True)
    if args.cpu_rehearsal:
        print("gpu_smoke: this was a CPU rehearsal of the script, not the GPU check", flush=True)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
