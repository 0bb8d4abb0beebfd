"""What configs/gpu_verl.yaml does on a GPU, proven on CPU as far as a CPU can (issue #35).

- the actor model loaded exactly as verl 0.9.1's FSDP worker loads it for the config (verl's own
  `HFModelConfig`, `ActorConfig`, `EngineRegistry` class and `FSDPEngine._build_module`, in a
  subprocess on agl_lab's CPU platform): verl's default attention (flash_attention_2) fails with
  transformers' ImportError where `flash_attn` is missing; the config's `sdpa` loads, and packed
  rows (verl's remove-padding input) give the padded rows' logits;
- the start-up check names a missing `flash_attn` before Ray or any worker starts, lists any
  import failure (not only ImportError) as a problem, and keeps vLLM's import-time environment
  edits out of the environment Ray's workers inherit;
- verl's rollout config accepts the config's vLLM keys, at 1 and 8 GPUs;
- a checkpoint's RNG capture creates no CUDA context on a driver that never used CUDA.

Wall time: ~30 s (one subprocess importing verl and building the tiny model twice).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
from omegaconf import OmegaConf, open_dict

from agl_lab.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CONFIG = os.path.join(ROOT, "configs", "gpu_verl.yaml")
ATTN_KEY = "actor_rollout_ref.model.override_config.attn_implementation"

pytest.importorskip("verl")


def _without_attention_override(tmp_path) -> str:
    """configs/gpu_verl.yaml as it was before #35: no attn_implementation (verl's default)."""
    cfg = OmegaConf.load(GPU_CONFIG)
    del cfg.actor_rollout_ref.model.override_config["attn_implementation"]
    path = tmp_path / "gpu_verl_verl_default_attention.yaml"
    OmegaConf.save(cfg, path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_model_dir():
    from agl_lab.engines.tiny import tiny_model_dir

    return str(tiny_model_dir())


def test_the_model_loads_as_verl_worker_loads_it_with_the_gpu_config(tmp_path, tiny_model_dir):
    default_attention = _without_attention_override(tmp_path)
    script = textwrap.dedent(f"""
        import json
        from agl_lab.config import load_config
        from agl_lab.engines.verl.cpu import activate
        from agl_lab.engines.verl.model_load import actor_configs, describe, load_actor_module
        activate()
        for name, path in (("gpu_verl", {GPU_CONFIG!r}), ("verl_default", {default_attention!r})):
            cfg = load_config(path, ["agl_lab.model.path={tiny_model_dir}"])
            model_config, actor = actor_configs(cfg)
            seen = {{"engine": type(actor.engine).__name__, "strategy": actor.engine.strategy,
                     "remove_padding": actor.engine.use_remove_padding,
                     "micro_batch": actor.engine.micro_batch_size_per_gpu}}
            try:
                print(json.dumps({{"config": name, "ok": True, **seen, **describe(load_actor_module(cfg))}}))
            except Exception as exc:
                print(json.dumps({{"config": name, "ok": False, "error": f"{{type(exc).__name__}}: {{exc}}"}}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = {r["config"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    gpu = results["gpu_verl"]
    assert gpu["ok"], gpu
    assert (gpu["class"], gpu["attn_implementation"], gpu["dtype"]) == ("Qwen2ForCausalLM", "sdpa", "float32")
    assert gpu["gradient_checkpointing"] and gpu["remove_padding"] and gpu["micro_batch"] == 1
    assert (gpu["engine"], gpu["strategy"]) == ("FSDPEngineConfig", "fsdp2")
    assert gpu["packed_vs_padded_max_abs"] < 1e-5, gpu  # measured 4.8e-7: packed rows do not attend across rows
    default = results["verl_default"]
    if importlib.util.find_spec("flash_attn") is None:
        assert (
            not default["ok"] and default["error"].startswith("ImportError") and "FlashAttention2" in default["error"]
        ), default
    else:  # a GPU environment with flash-attn installed: verl's default loads too
        assert default["ok"] and default["attn_implementation"] == "flash_attention_2", default


def test_the_start_up_check_names_a_missing_flash_attn_before_ray_starts(tmp_path, tiny_model_dir):
    import ray

    from agl_lab.engines.verl.api import check_attention
    from agl_lab.engines.verl.engine import VerlEngine

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    assert check_attention(load_config(GPU_CONFIG)) == []  # sdpa: nothing to install
    cfg = load_config(_without_attention_override(tmp_path), [f"agl_lab.model.path={tiny_model_dir}"])
    assert not ray.is_initialized()
    with pytest.raises(
        RuntimeError,
        match=r"(?s)cannot start with this config.*attn_implementation=flash_attention_2 "
        r"\(verl default, not set\) needs the flash_attn package.*set it to sdpa",
    ):
        VerlEngine(cfg, train_dataset=[{"question": "q"}])
    assert not ray.is_initialized()  # nothing was started
    explicit = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{ATTN_KEY}=flash_attention_3"]))
    assert "flash_attn_interface package" in check_attention(explicit)[0]
    assert check_attention(cfg, find_spec=lambda name: True) == []  # found on the nodes (a joined cluster)
    assert "on every Ray node" in check_attention(cfg, find_spec=lambda name: False)[0]


def test_the_start_up_check_lists_any_import_failure_and_keeps_the_environment(tmp_path, monkeypatch):
    from agl_lab.engines.verl import api

    (tmp_path / "agl_probe_broken.py").write_text("raise RuntimeError('CUDA driver version is insufficient')\n")
    (tmp_path / "agl_probe_env.py").write_text(
        "import os\nos.environ['NCCL_CUMEM_ENABLE'] = '0'\nos.environ['AGL_PROBE_SET'] = '1'\ndef f(x): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    monkeypatch.delenv("AGL_PROBE_SET", raising=False)
    rows = {"broken": api.VerlSymbol("agl_probe_broken:f"), "env": api.VerlSymbol("agl_probe_env:f", ("x",))}
    monkeypatch.setattr(api, "VERL_API", rows)
    problems = api.check_verl_api(include_vllm=True)
    assert problems == ["agl_probe_broken:f: cannot import (RuntimeError: CUDA driver version is insufficient)"]
    assert os.environ["NCCL_CUMEM_ENABLE"] == "1" and "AGL_PROBE_SET" not in os.environ  # put back
    assert sys.modules["agl_probe_env"]  # the import itself happened


@pytest.mark.parametrize("gpus", [1, 8])
def test_verl_rollout_actor_and_ref_configs_accept_the_gpu_config(gpus):
    from agl_lab.engines.verl.api import verl_import

    cfg = load_config(GPU_CONFIG, [f"trainer.n_gpus_per_node={gpus}", f"data.train_batch_size={4 * gpus}"])
    to_dataclass = verl_import("omega_conf_to_dataclass")
    rollout = to_dataclass(cfg.actor_rollout_ref.rollout)
    assert type(rollout).__name__ == "RolloutConfig"
    assert (rollout.name, rollout.mode, rollout.n, rollout.gpu_memory_utilization) == ("vllm", "async", 4, 0.6)
    # verl passes engine_kwargs.vllm to `vllm serve` as CLI flags (vLLMHttpServer.launch_server)
    assert dict(rollout.engine_kwargs["vllm"]) == {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    actor = to_dataclass(cfg.actor_rollout_ref.actor)
    assert (actor.strategy, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz) == ("fsdp2", 1, False)
    assert actor.fsdp_config.param_offload and actor.fsdp_config.optimizer_offload
    ref_cfg = cfg.actor_rollout_ref.ref  # the worker's rewrite before building it (ActorRolloutRefWorker.init_model)
    with open_dict(ref_cfg):
        ref_cfg.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref_cfg.ppo_micro_batch_size = ref_cfg.pop("log_prob_micro_batch_size", None)
        ref_cfg.ppo_micro_batch_size_per_gpu = ref_cfg.pop("log_prob_micro_batch_size_per_gpu", None)
        ref_cfg.use_dynamic_bsz = ref_cfg.pop("log_prob_use_dynamic_bsz", False)
        ref_cfg.ppo_max_token_len_per_gpu = ref_cfg.pop("log_prob_max_token_len_per_gpu", None)
    ref = to_dataclass(ref_cfg)
    assert ref.strategy == "fsdp2" and ref.ppo_micro_batch_size_per_gpu == 1
    assert cfg.reward.num_workers == 0 and cfg.data.dataloader_num_workers == 0
    assert (
        cfg.trainer.balance_batch is True and cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    )


def test_rng_state_creates_no_cuda_context_on_a_driver_that_never_used_cuda(monkeypatch):
    import torch

    from agl_lab import checkpoints

    def no_context(*_):
        raise AssertionError("get_rng_state_all() initialises CUDA on every visible GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as the verl driver sees it
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", no_context)
    assert "cuda" not in checkpoints.rng_state()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the local engine on a GPU
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["state"])
    assert checkpoints.rng_state()["cuda"] == ["state"]


# ------------------------------------------------------------------------------------------
# Issue #48: what the GPU environment lacks, named before Ray starts
# ------------------------------------------------------------------------------------------

BLOCK_PSYCOPG = "import sys\nsys.modules['psycopg'] = sys.modules['psycopg_pool'] = None  # 'not installed'\n"


def _python(code: str, tmp_path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path)
    )


def test_a_run_with_the_default_store_imports_no_psycopg(tmp_path):
    """The store package's docstring promises psycopg "on first use": requirements-gpu.txt once
    lacked it, and `agl-lab train` died after Ray, the workers and vLLM had started."""
    out = _python(
        BLOCK_PSYCOPG
        + textwrap.dedent("""
        import agl_lab.cli, agl_lab.trainer, agl_lab.execution, agl_lab.server.embedded, agl_lab.server.app
        from agl_lab.server.backends import open_store
        print("loaded:", sorted(m for m in sys.modules if m.startswith("agl_lab.server.store.p")))
        try:
            open_store("postgresql://u:p@127.0.0.1:1/db")
        except ImportError as exc:
            print("postgres:", exc.name)
    """),
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded: []" in out.stdout  # neither postgresql.py, pg_schema.py nor pg_servers.py
    assert "postgres: psycopg" in out.stdout  # the PostgreSQL store still needs it, when named


def test_the_start_up_check_names_missing_psycopg_for_a_postgres_store_before_ray_starts(tmp_path, tiny_model_dir):
    code = BLOCK_PSYCOPG + textwrap.dedent(f"""
        import ray
        from agl_lab.config import load_config
        from agl_lab.engines.verl.api import StartupProblem, check_dependencies
        from agl_lab.engines.verl.engine import VerlEngine
        cfg = load_config({GPU_CONFIG!r}, ["agl_lab.model.path={tiny_model_dir}"])
        print("memory store:", check_dependencies(cfg))
        pg = load_config({GPU_CONFIG!r}, ["agl_lab.model.path={tiny_model_dir}",
                                          "agl_lab.server.store=postgresql://u:p@db:5432/agl"])
        try:
            VerlEngine(pg, train_dataset=[{{"question": "q"}}])
        except StartupProblem as exc:
            print("problem:", " ".join(str(exc).split()))
        print("ray started:", ray.is_initialized())
    """)
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memory store: []" in out.stdout
    problem = next(line for line in out.stdout.splitlines() if line.startswith("problem:"))
    assert "agl_lab.server.store=postgresql://... needs the psycopg module, which is not installed" in problem
    assert "pip install -r requirements-gpu.txt (or pip install 'psycopg[binary]')" in problem
    assert "psycopg_pool module" in problem
    assert "ray started: False" in out.stdout


def test_the_server_packages_the_start_up_check_names_are_those_the_server_imports(tmp_path):
    """Every module of a requirements-gpu.txt distribution that the server and gateway import,
    beyond what `agl-lab train` imports before the engine starts, is in `SERVER_PACKAGES`."""
    from agl_lab.engines.verl.api import SERVER_PACKAGES, check_dependencies

    code = textwrap.dedent("""
        import importlib.metadata as md, json, re, sys
        import agl_lab.cli, agl_lab.config, agl_lab.trainer
        before = {m.split(".")[0] for m in sys.modules}
        import agl_lab.agent, agl_lab.execution, agl_lab.server.app, agl_lab.server.embedded, agl_lab.server.upstream
        dists = md.packages_distributions()
        lines = [l.split("#")[0].strip() for l in open(sys.argv[1])]
        gpu = {re.match(r"[A-Za-z0-9_.-]+", l).group(0).lower() for l in lines if l}
        late = {m.split(".")[0] for m in sys.modules} - before
        print(json.dumps(sorted(m for m in late if any(d.lower() in gpu for d in dists.get(m, ())))))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code, os.path.join(ROOT, "requirements-gpu.txt")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    late = json.loads(out.stdout.splitlines()[-1])
    assert {"fastapi", "uvicorn", "httptools"} <= set(late)  # the comparison below is not empty
    assert set(late) <= set(SERVER_PACKAGES), set(late) - set(SERVER_PACKAGES)  # each one named before Ray
    missing = check_dependencies(load_config(GPU_CONFIG), find_spec=lambda name: name != "httptools")
    assert missing == [
        "agl_lab's server needs the httptools module, which is not installed: pip install -r requirements-gpu.txt "
        "(or pip install 'httptools')"
    ]


def test_the_compile_escape_hatch_docs_gpu_md_gives_reaches_verls_configs():
    """docs/gpu.md: without gcc or Python.h, turn compilation off with these keys."""
    from agl_lab.engines.verl.api import verl_import

    hatch = ["actor_rollout_ref.actor.use_torch_compile=false", "actor_rollout_ref.rollout.enforce_eager=true"]
    cfg = load_config(GPU_CONFIG, hatch)
    to_dataclass = verl_import("omega_conf_to_dataclass")
    assert to_dataclass(cfg.actor_rollout_ref.rollout).enforce_eager is True
    assert to_dataclass(cfg.actor_rollout_ref.actor).use_torch_compile is False
    assert cfg.actor_rollout_ref.ref.use_torch_compile is False  # verl's ref follows the actor's key
    default = load_config(GPU_CONFIG)
    assert default.actor_rollout_ref.actor.use_torch_compile and not default.actor_rollout_ref.rollout.enforce_eager
