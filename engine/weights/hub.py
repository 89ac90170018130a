"""A model name -> the local files the engine reads.

`LLM("Qwen/Qwen2.5-0.5B-Instruct")`, `fusegen run --model org/name [--revision REV]`: a
name that is not an existing local path and is spelled like a hub id (`org/name`)
resolves through the Hugging Face cache, downloading what is missing when the machine
can. Only what fusegen reads is fetched (configs, tokenizer files, safetensors, chat
templates), never pickles or the other formats a repository may carry.
`HF_HUB_OFFLINE=1` never touches the network; `HF_HUB_CACHE` / `HF_HOME` pick the cache.
Both are read on each call, not when `huggingface_hub` was imported, so a process may set
them after importing it. An existing local path is returned unchanged; any other name is
a local path that does not exist and fails as one.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from fusegen.engine.errors import ModelLoadError

# What fusegen reads from a checkpoint directory: config.json, generation_config.json,
# tokenizer.json, tokenizer_config.json, special_tokens_map.json,
# model.safetensors.index.json, *.safetensors and chat_template.jinja.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja")

# org/name: letters, digits, '-', '_', '.'; no '--' or '..' (the hub refuses them), and
# neither part starts with '.' or '-' (so ./x, ../x, -x stay local paths).
_HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]{0,95}/[A-Za-z0-9_][\w.-]{0,95}")
_TRUE = ("1", "on", "yes", "true")


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and "--" not in name and ".." not in name \
        and not name.endswith(".")


def resolve_model(model: str, revision: str | None = None) -> str:
    """The local path the engine reads for `model`: the path itself when it exists, else
    the hub snapshot of `model` at `revision` (a branch, tag or commit; default main)."""
    model = str(model)
    local = os.path.expanduser(model)
    if os.path.exists(local):
        if revision is not None:
            raise ModelLoadError(f"revision {revision!r} was given but {model} is a local "
                                 "path, which has no revisions; drop the revision, or name "
                                 "the model by its hub id (org/name)")
        return local
    if not looks_like_hub_id(model):
        raise ModelLoadError(f"model {model}: no such file or directory; pass a checkpoint "
                             "directory, a .gguf file, or a Hugging Face hub id (org/name)")
    return _snapshot(model, revision)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as it is now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.strip().lower() in _TRUE


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, from the environment as it is now."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = env.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(home, "hub").expanduser()


def _snapshot(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline, cache = hub_offline(), hub_cache_dir()
    named = repo_id if revision is None else f"{repo_id} at revision {revision}"
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                 allow_patterns=list(ALLOW_PATTERNS), local_files_only=offline)
    except LocalEntryNotFoundError:
        raise ModelLoadError(_not_cached(repo_id, revision, named, cache, offline)) from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"model {repo_id} has no revision {revision!r} on the hub; "
                             "pass a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"model {repo_id}: no such repository on the Hugging Face hub, or it is private "
            "or gated; check the name, or log in (`hf auth login`, or HF_TOKEN) with an "
            "account that has access") from None
    except HfHubHTTPError as exc:
        raise ModelLoadError(f"model {named}: the hub refused the download ({exc}); retry, "
                             "or download it on another machine and copy the cache") from None
    if not (Path(path) / "config.json").is_file():
        raise ModelLoadError(f"model {named} (cached in {path}) has no config.json: it is not "
                             "a Hugging Face checkpoint directory; for a GGUF repository, "
                             "download its .gguf file and pass that path")
    return path


def _not_cached(repo_id: str, revision: str | None, named: str, cache: Path,
                offline: bool) -> str:
    why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
    pin = "" if revision is None else f" --revision {revision}"
    return (f"model {named} is not in the hub cache {cache} and {why}; download it on a "
            f"machine that can reach the hub (`hf download {repo_id}{pin}`) and copy that "
            f"cache here, or set HF_HOME (or HF_HUB_CACHE) to a cache that holds it"
            + ("" if offline else ", or check this machine's network"))
