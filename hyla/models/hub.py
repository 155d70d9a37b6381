"""Where a model argument points: a directory, a bundled model's name, or a Hugging Face Hub id.

    resolve_model("moonshotai/Kimi-Linear-48B-A3B-Instruct")   # -> .../snapshots/<commit>

A Hub id (`org/name`) is looked up in the local Hugging Face cache, in the layout
huggingface_hub writes:

    <cache>/models--<org>--<name>/refs/<revision>        the commit a branch or tag points to
    <cache>/models--<org>--<name>/snapshots/<commit>/     the files of that commit

<cache> is $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub (huggingface_hub's own rule). A snapshot that is missing there is
downloaded with huggingface_hub (the optional `hub` extra) unless $HF_HUB_OFFLINE is set: only
safetensors, JSON configs, tokenizer files and chat templates, never pickles or remote code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# `org/name` as the Hub spells repository ids: letters, digits, `-`, `_`, `.` (no `..`, no
# leading or trailing `-` / `.`), one slash.
_REPO_ID = re.compile(r"^(?!.*\.\.)[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")

# What a checkpoint needs to be served (vLLM's safetensors-only download, plus the tiktoken
# tokenizer files Kimi releases ship and the chat templates kept beside the config).
DOWNLOAD_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "tiktoken.model", "*.tiktoken",
                     "tokenizer.model", "*.jinja", "*.txt"]


def is_repo_id(model: str) -> bool:
    """True when `model` is spelled like a Hub repository id (`org/name`)."""
    return bool(_REPO_ID.match(model))


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache directory (see the module docstring for the order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached_snapshot(repo_id: str, revision: str | None = None, cache_dir: Path | None = None) -> Path | None:
    """The cached snapshot of `repo_id` at `revision` (a branch, tag or commit; None = "main")
    that holds a config.json, or None."""
    cache_dir = hub_cache_dir() if cache_dir is None else cache_dir
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    revision = revision or "main"
    commit = revision if _COMMIT.match(revision) else None
    ref = repo / "refs" / revision
    if commit is None and ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    if commit is None:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def _download(repo_id: str, revision: str | None, cache_dir: Path) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"model {repo_id!r} is not a directory, a bundled model, or in the Hugging Face cache "
                         f"{cache_dir}; install huggingface_hub (pip install 'hyla[hub]') to download it, or "
                         "pass a checkpoint directory") from None
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(cache_dir),
                                 allow_patterns=DOWNLOAD_PATTERNS)
    except Exception as e:  # noqa: BLE001 - network, auth or not-found: one clear message
        raise ValueError(f"model {repo_id!r} (revision {revision or 'main'}) is not in the Hugging Face cache "
                         f"{cache_dir} and could not be downloaded: {type(e).__name__}: {e}") from None
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"the Hub repository {repo_id!r} has no config.json")
    return Path(path)


def resolve_hub_model(repo_id: str, revision: str | None = None) -> str:
    """The local directory of Hub model `repo_id`: its cached snapshot, downloaded first when
    missing and the network is allowed. ValueError names the id and the cache searched."""
    cache_dir = hub_cache_dir()
    snapshot = cached_snapshot(repo_id, revision, cache_dir)
    if snapshot is not None:
        return str(snapshot)
    if _offline():
        raise ValueError(f"model {repo_id!r} (revision {revision or 'main'}) is not in the Hugging Face cache "
                         f"{cache_dir}, and HF_HUB_OFFLINE is set: download it first or pass a directory")
    return str(_download(repo_id, revision, cache_dir))


def resolve_model(model: str | os.PathLike | None, revision: str | None = None) -> str:
    """A checkpoint directory for `model`:
    - None: the bundled default model;
    - an existing path: itself (a path always wins over a name);
    - a bundled model's name ("default", "qwen3.5-mtp"): its directory in the package;
    - `org/name`: the Hugging Face cache snapshot (downloaded when missing, see resolve_hub_model).
    Anything else is returned unchanged, for the loader to say what is wrong with it. `revision`
    (a branch, tag or commit) applies to Hub ids only; with another kind of model it is a
    ValueError."""
    from hyla.models.default import BUNDLED_MODELS, bundled_model_path, default_model_path

    if model is None:
        resolved = default_model_path()
    else:
        model = os.fspath(model)
        if Path(model).exists():
            resolved = model
        elif model in BUNDLED_MODELS:
            resolved = bundled_model_path(model)
        elif is_repo_id(model):
            return resolve_hub_model(model, revision)
        else:
            resolved = model
    if revision is not None:
        raise ValueError(f"revision {revision!r} applies to Hugging Face Hub ids only, not to {resolved!r}")
    return resolved
