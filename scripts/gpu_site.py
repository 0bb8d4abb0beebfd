"""Pack what a bare GPU machine lacks to run agl_lab's local engine: a Python 3.12 site folder, as a tarball.

A GPU machine with torch (CUDA build) and transformers but no network and no verl cannot run
`scripts/gpu_smoke.sh`'s A5 check (agl_lab's local engine, bf16 steps) or the README demo on
`cuda`: the local engine imports verl's learning core, verl imports Ray. This script installs,
for CPython 3.12 on manylinux x86-64, the wheels of the distributions below at the versions
installed in *this* environment (so the GPU machine runs what CI tested), strips Ray down to
what `import ray` needs (no GCS/raylet server binaries, jars, dashboard or Ray's libraries:
the local engine never starts a Ray node), and writes one tarball:

    .venv/bin/python scripts/gpu_site.py --out .gpu-site/site.tgz      # ~45 MB, ~1 min
    .venv/bin/python scripts/gpu_site.py --list                          # the pins only, nothing fetched

On the GPU machine, in the checkout:

    tar xzf .gpu-site/site.tgz -C /tmp && export PYTHONPATH=/tmp/gpu-site:$PWD
    PYTHON=python3 scripts/gpu_smoke.sh --tier A                         # A5 runs instead of SKIP
    python3 -m agl_lab.cli train configs/cpu_tiny.yaml --run-dir /tmp/demo agl_lab.model.device=cuda

`transformers`/`tokenizers`/`huggingface_hub` are packed too: the image's newer transformers is
outside pyproject.toml's pin. docs/gpu.md "Run on a GPU" has what this gave on an H200.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# What a bare torch + transformers image lacks for a local-engine step, found by importing one
# (`sys.modules` after `Trainer.step()` on CPU, mapped to distributions, less the image's packages).
DISTRIBUTIONS = (
    "verl tensordict pyvers codetiming dill omegaconf ray protobuf opentelemetry-api opentelemetry-sdk "
    "opentelemetry-proto opentelemetry-semantic-conventions opentelemetry-exporter-prometheus "
    "opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-http "
    "opentelemetry-exporter-otlp-common opentelemetry-exporter-http-transport google-api-core google-auth "
    "googleapis-common-protos jsonschema jsonschema-specifications referencing rpds-py jsonpointer fqdn "
    "isoduration arrow uri-template webcolors rfc3339-validator rfc3986-validator rfc3987-syntax lark "
    "fastapi starlette uvicorn httptools websockets pydantic pydantic_core annotated-types typing-inspection "
    "openai jiter distro sniffio httpx2 httpcore2 truststore orjson cachetools psycopg psycopg-binary "
    "psycopg-pool pytz wcwidth transformers tokenizers huggingface_hub"
).split()
# Published as an sdist only (pure Python): copied from this environment's site-packages.
COPIED = {"antlr4-python3-runtime": ["antlr4"]}
# Ray's parts that only a running Ray node or Ray's own libraries use (~160 MB of its ~240 MB).
RAY_UNUSED = "core/src/ray/gcs core/src/ray/raylet jars rllib dashboard serve train tune llm data".split()
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def pins() -> list[str]:
    """`name==version` for each distribution, the versions this environment has installed."""
    missing = []
    out = []
    for name in DISTRIBUTIONS:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise SystemExit(f"gpu_site: this environment lacks {missing}: run it with agl_lab's .venv/bin/python")
    return out


def build(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "gpu-site"
        platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(site), "--no-deps",
             "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
             *platform_args, *pins()],
            check=True,
        )  # fmt: skip
        here = Path(metadata.distribution("omegaconf").locate_file(""))  # this environment's site-packages
        for name, packages in COPIED.items():
            for package in packages:
                shutil.copytree(here / package, site / package)
            for info in here.glob(f"{name.replace('-', '_')}-*.dist-info"):
                shutil.copytree(info, site / info.name)
        for part in RAY_UNUSED:
            shutil.rmtree(site / "ray" / part, ignore_errors=True)
        for cache in site.rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:gz") as tar:
            tar.add(site, arcname="gpu-site")
    print(f"gpu_site: {out} ({out.stat().st_size / 2**20:.1f} MiB); on the GPU machine: "
          f"tar xzf {out} -C /tmp && export PYTHONPATH=/tmp/gpu-site:$PWD")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu-site/site.tgz"))
    parser.add_argument("--list", action="store_true", help="print the pinned distributions; fetch nothing")
    args = parser.parse_args()
    if args.list:
        print("\n".join(pins() + [f"{name} (copied)" for name in COPIED]))
        return
    build(args.out)


if __name__ == "__main__":
    main()
