"""The C++ kernels build at engine start-up, in a folder keyed by the sources' content; a failed build falls back."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from radixlm.kernels import cpu_ext


def _copy_sources(dest: Path) -> list[Path]:
    shutil.copytree(cpu_ext.CSRC, dest)
    return cpu_ext.source_files(dest)


def test_kernel_build_folder_depends_on_source_content_not_on_the_checkout_path(tmp_path):
    a = _copy_sources(tmp_path / "checkout_a" / "csrc")
    b = _copy_sources(tmp_path / "checkout_b" / "csrc")
    assert cpu_ext.build_folder(a, tmp_path) == cpu_ext.build_folder(b, tmp_path) == cpu_ext.build_folder(None, tmp_path)
    for header in (p for p in b if p.suffix == ".h"):  # headers count too: they are compiled in
        text = header.read_text()
        i = next(i for i, c in enumerate(text) if c.isalpha())
        header.write_text(text[:i] + text[i].swapcase() + text[i + 1 :])  # same length, other content
        assert cpu_ext.build_folder(a, tmp_path) != cpu_ext.build_folder(cpu_ext.source_files(header.parent), tmp_path)
        header.write_text(text)


def test_kernel_build_key_changes_with_the_compiler_flags(tmp_path):
    files = cpu_ext.source_files()
    assert cpu_ext.build_key(files) != cpu_ext.build_key(files, cflags=(*cpu_ext.CFLAGS, "-DNDEBUG"))
    assert cpu_ext.build_key(files) != cpu_ext.build_key(files, ldflags=())


def test_radixlm_cpu_march_builds_for_the_named_target_in_its_own_folder(monkeypatch):
    files = cpu_ext.source_files()
    native = cpu_ext.build_key(files)
    monkeypatch.setenv("RADIXLM_CPU_MARCH", "haswell")  # AVX2 only, on a CPU with AVX-512
    assert "-march=haswell" in cpu_ext.compile_flags() and "-march=native" not in cpu_ext.compile_flags()
    assert cpu_ext.build_key(files) != native
    monkeypatch.setenv("RADIXLM_CPU_MARCH", "haswell -o /etc/passwd")
    with pytest.raises(ValueError, match="RADIXLM_CPU_MARCH"):
        cpu_ext.compile_flags()
    monkeypatch.delenv("RADIXLM_CPU_MARCH")
    assert cpu_ext.compile_flags() == cpu_ext.CFLAGS and cpu_ext.build_key(files) == native


def test_kernel_build_key_differs_between_torch_installations():
    # torch's builder writes its headers' paths into build.ninja: two virtualenvs sharing one
    # folder rebuilt it for each other at every start (a server took minutes to become healthy)
    files = cpu_ext.source_files()
    assert cpu_ext.build_key(files) == cpu_ext.build_key(files)
    assert cpu_ext.build_key(files, torch_dir="/venv_a/torch") != cpu_ext.build_key(files, torch_dir="/venv_b/torch")


def test_failed_kernel_build_falls_back_to_pytorch_with_one_warning(monkeypatch, caplog, tmp_path):
    calls = []

    def broken(folder: Path, sources: list[str]):
        calls.append(folder)
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_ext, "_module", cpu_ext._UNSET)
    monkeypatch.setattr(cpu_ext, "_compile", broken)
    with caplog.at_level(logging.WARNING, logger=cpu_ext.__name__):
        assert cpu_ext.cpu_kernels() is None
        assert cpu_ext.cpu_kernels() is None
    assert len(calls) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no compiler here" in warnings[0].getMessage()
    assert calls[0].parent == tmp_path / "torch_extensions"
    assert sorted(p.name for p in (calls[0] / "src").iterdir()) == sorted(p.name for p in cpu_ext.source_files())


def test_engine_builds_the_kernels_before_it_is_ready(tiny_llama, monkeypatch):
    from radixlm.runtime.engine import build_parts
    from radixlm.runtime.executor import model_runner
    from radixlm.runtime.server_args import ServerArgs

    built = []
    monkeypatch.setattr(model_runner, "cpu_kernels", lambda: built.append(True))
    build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=256))
    assert built == [True]


def test_a_build_lock_left_by_a_killed_build_does_not_block_the_next_build(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    folder = tmp_path / "cpu_kernels_x"
    (folder / "src").mkdir(parents=True)
    (folder / "lock").write_text("")  # what torch's builder leaves when its process is killed
    seen = []

    def fake_load(**kwargs):
        seen.append((folder / "lock").exists())
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert cpu_ext._compile(folder, ["bindings.cpp"]) == "module"
    assert seen == [False]  # torch's wait (which has no time limit) would otherwise never end
