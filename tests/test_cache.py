"""agl_lab/cache.py: the cache's root, and a directory built there once, atomically."""

from __future__ import annotations

import pytest

from agl_lab.cache import build_cached_dir, cache_root


def test_cache_root_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AGL_LAB_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("AGL_LAB_CACHE")
    assert cache_root().parts[-2:] == (".cache", "agl_lab")


def test_a_directory_is_built_once_and_moved_into_place(tmp_path):
    calls = []

    def build(tmp):
        calls.append(tmp)
        (tmp / "config.json").write_text("{}")

    target = tmp_path / "sub" / "model"
    assert build_cached_dir(target, build) == target
    assert build_cached_dir(target, build) == target  # a cache hit: not built again
    assert len(calls) == 1 and calls[0] != target and (target / "config.json").exists()
    assert [p.name for p in target.parent.iterdir()] == ["model"]  # no temporary directory left


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    def build(tmp):
        (tmp / "half.bin").write_text("x")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_cached_dir(tmp_path / "model", build)
    assert list(tmp_path.iterdir()) == []
