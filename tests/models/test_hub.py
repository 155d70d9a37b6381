"""Hub ids resolved in the local Hugging Face cache layout (no network: a fake cache, and a
patched snapshot_download where a download is asked for)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hyla.models import load_model
from hyla.models.hub import DOWNLOAD_PATTERNS, cached_snapshot, hub_cache_dir, is_repo_id, resolve_model
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint

MAIN, V1 = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("hub_src"), "dense", with_tokenizer=True)


@pytest.fixture
def cache(tmp_path, monkeypatch, checkpoint):
    """HF_HUB_CACHE with org/tiny at refs/main -> MAIN and refs/v1 -> V1."""
    root = tmp_path / "hub"
    repo = root / "models--org--tiny"
    for commit in (MAIN, V1):
        shutil.copytree(checkpoint, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1 + "\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return root


def test_cache_dir_follows_huggingface_hubs_environment(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_repo_id_spelling():
    assert is_repo_id("moonshotai/Kimi-Linear-48B-A3B-Instruct") and is_repo_id("Qwen/Qwen3.5-35B-A3B")
    for bad in ("/abs/path", "./rel/dir", "a/b/c", "org/..", "org/-x", "noslash", "org/na me"):
        assert not is_repo_id(bad), bad


def test_hub_ids_resolve_to_cached_snapshots_by_branch_tag_or_commit(cache):
    repo = cache / "models--org--tiny" / "snapshots"
    assert resolve_model("org/tiny") == str(repo / MAIN)
    assert resolve_model("org/tiny", revision="v1") == str(repo / V1)
    assert resolve_model("org/tiny", revision=V1) == str(repo / V1)  # a commit needs no ref
    assert cached_snapshot("org/tiny", "v2") is None


def test_paths_and_bundled_names_keep_their_meaning(cache, tmp_path, monkeypatch):
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == "org/tiny"  # an existing directory wins over a Hub id
    with pytest.raises(ValueError, match="revision 'v1' applies to Hugging Face Hub ids only"):
        resolve_model("default", revision="v1")


def test_load_model_and_llm_take_a_hub_id(cache, checkpoint):
    from hyla.engine import LLM

    a = load_model("org/tiny", dtype=torch.float32)
    b = load_model(str(checkpoint), dtype=torch.float32)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    llm = LLM("org/tiny", revision="v1", device="cpu", max_model_len=64, memory_budget=1 << 22)
    assert llm.engine.config.model == str(cache / "models--org--tiny" / "snapshots" / V1)
    assert llm.tokenizer is not None  # found beside the snapshot's config
    assert llm.generate("the cat", llm.get_default_sampling_params())[0].outputs


def test_offline_or_missing_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=rf"'org/other'.*not in the Hugging Face cache {cache}.*HF_HUB_OFFLINE"):
        resolve_model("org/other")


def test_a_missing_snapshot_is_downloaded_safetensors_and_configs_only(cache, checkpoint, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, **_):
        calls.append((repo_id, revision, cache_dir, allow_patterns))
        target = Path(cache_dir) / "models--org--new" / "snapshots" / MAIN
        shutil.copytree(checkpoint, target)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    path = resolve_model("org/new", revision="main")
    assert calls == [("org/new", "main", str(cache), DOWNLOAD_PATTERNS)]
    assert path.endswith(MAIN) and (Path(path) / "config.json").is_file()
    assert not any(p.endswith((".bin", ".pt", ".py")) for p in DOWNLOAD_PATTERNS)

    def failing(*args, **kwargs):
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ValueError, match=r"'org/gone'.*could not be downloaded: OSError: connection refused"):
        resolve_model("org/gone")


def test_cli_takes_the_model_positionally_and_serves_it_under_its_id(cache, monkeypatch):
    import hyla.cli as cli

    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(config):
        seen["model"] = config.model
        raise Stop

    import hyla.engine

    monkeypatch.setattr(hyla.engine, "LLMEngine", fake_engine)
    with pytest.raises(Stop):
        cli.main(["serve", "org/tiny", "--revision", "v1", "--device", "cpu"])
    assert seen["model"] == str(cache / "models--org--tiny" / "snapshots" / V1)
