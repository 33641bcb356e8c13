"""Hugging Face hub ids ("Qwen/Qwen3-8B") resolved to a snapshot directory of the local Hugging Face cache.

`huggingface_hub` owns the cache's layout (`$HF_HUB_CACHE`, by default `$HF_HOME/hub`:
`models--org--name/snapshots/<commit>/`, `refs/<branch>`); this module only asks it. A cached, complete snapshot
is used without touching the network. Otherwise, when the hub may be reached (`HF_HUB_OFFLINE` unset), the
model's weights, configs and tokenizer files are downloaded with huggingface_hub's progress bars; offline,
`resolve_hub` raises one error naming the id, the cache it looked in and the `hf download` line to run.
huggingface_hub reads its environment (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE) when first imported.
"""

from __future__ import annotations

import re
from pathlib import Path

# what a model needs from a repository: configs (config, generation_config, tokenizer_config, the safetensors
# index), the weights in safetensors (not the .bin / .pth / consolidated copies some repositories also hold),
# the tokenizer and a separate chat template
DOWNLOAD_PATTERNS = ["*.json", "model*.safetensors", "tokenizer*", "*.jinja"]
REQUIRED_FILES = ("config.json", "tokenizer.json")

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubModelNotFound(ValueError):
    """A hub id that is not in the local cache and cannot be downloaded (offline, or the download failed)."""


def is_hub_id(spec: str) -> bool:
    """Whether `spec` has the form of a hub model id, "org/name" (callers check local paths first)."""
    return bool(_REPO_ID.match(spec)) and ".." not in spec


def cache_dir() -> Path:
    """The hub cache huggingface_hub reads and writes ($HF_HUB_CACHE, else $HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _complete(path: Path) -> bool:
    return all((path / n).is_file() for n in REQUIRED_FILES) and any(path.glob("*.safetensors"))


def download_command(repo_id: str, revision: str | None = None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"hf download {repo_id}{rev}"


def resolve_hub(repo_id: str, revision: str | None = None, cache: str | Path | None = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` (a branch, tag or commit; None: main) in the hub
    cache `cache` (default: huggingface_hub's), downloading what is missing when online. Raises
    HubModelNotFound when it is not cached (completely) and cannot be downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = Path(cache) if cache is not None else cache_dir()
    local: Path | None = None
    try:
        local = Path(snapshot_download(repo_id, revision=revision, cache_dir=where, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if local is not None and _complete(local):
        return local
    what = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    found = "has only part of it" if local is not None else "does not have it"
    fix = (f"download it where the hub is reachable with `{download_command(repo_id, revision)}` (into this cache: "
           f"the same HF_HOME / HF_HUB_CACHE), or pass a local directory")
    if offline():
        raise HubModelNotFound(f"model {what} is not in the Hugging Face cache: {where} {found}, and downloads "
                               f"are off (HF_HUB_OFFLINE is set). To get it, {fix}.")
    try:  # huggingface_hub shows a progress bar per file
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=where, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as e:  # no connection, unknown or gated repository, revision not found, ...
        raise HubModelNotFound(f"model {what} is not in the Hugging Face cache ({where} {found}) and downloading "
                               f"it failed: {e}. To get it, {fix}.") from e
    if not _complete(path):
        raise HubModelNotFound(f"model {what} at {path} lacks {', '.join(REQUIRED_FILES)} or *.safetensors "
                               "weights: sgnb loads safetensors checkpoints with a tokenizer.json")
    return path


def cached_model_ids(cache: str | Path | None = None) -> list[str]:
    """Model ids with at least one snapshot in the hub cache, sorted (what `%sgl model <Tab>` offers). Never
    touches the network; an absent or unreadable cache gives []."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(Path(cache) if cache is not None else cache_dir())
    except Exception:  # CacheNotFound, permissions
        return []
    return sorted(r.repo_id for r in info.repos if r.repo_type == "model" and r.revisions)
