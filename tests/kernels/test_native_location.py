"""Where the native kernels are loaded from: the environment's install-time build first, the
cache's build (made on first use) otherwise."""

from __future__ import annotations

import sys

import pytest

from longattn.ops import native
from longattn.ops.build import library_path


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A private environment prefix and cache; ``built`` records what ensure_built was asked."""
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "env"))
    monkeypatch.setenv("LONGATTN_CACHE", str(tmp_path / "cache"))
    built = []

    def fake_build(spec, build_dir, timeout=None):
        built.append(build_dir)
        return library_path(spec, build_dir)
    monkeypatch.setattr(native, "ensure_built", fake_build)
    return tmp_path, built


def test_the_install_time_build_is_loaded_without_building(places):
    tmp_path, built = places
    so = library_path(native.kernel_spec(), native.installed_dir())
    so.parent.mkdir(parents=True)
    so.write_bytes(b"")
    assert native.library() == so and built == []
    assert native.installed_dir().is_relative_to(tmp_path / "env")


def test_without_an_install_time_build_the_cache_builds_one(places):
    tmp_path, built = places
    so = native.library()
    assert built == [so.parent] and so.is_relative_to(tmp_path / "cache" / "kernels")
    assert so.parent.name == native.installed_dir().name  # one name: torch version and sources


def test_the_install_step_builds_into_the_environment(places):
    tmp_path, built = places
    if not native._cpu_runs_avx2():
        assert native.main() == 1 and built == []
    else:
        assert native.main() == 0 and built == [native.installed_dir()]
