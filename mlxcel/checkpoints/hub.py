"""`model.path=org/name`: a Hugging Face Hub repo id, resolved through huggingface_hub's cache.

The cache answers first (so a cached snapshot works offline); only a repo that is not cached is
downloaded, and only the files a model folder needs. Offline with nothing cached, the error names
the repo, the cache and the command that fetches it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mlxcel.errors import MlxcelError

# org/name as the Hub spells repo ids; a local path that exists always wins over this reading.
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# What a model folder needs: config, weights (safetensors or GGUF), tokenizer and template files.
MODEL_FILES = ["*.json", "*.safetensors", "*.gguf", "*.model", "*.tiktoken", "*.jinja", "*.txt"]


def is_repo_id(path: str) -> bool:
    return bool(REPO_ID.match(path)) and not Path(path).expanduser().exists()


def resolve_repo(repo_id: str) -> Path:
    """The local snapshot folder of `repo_id`, downloading it when it is not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    fetch = f"fetch it where the Hub is reachable (`hf download {repo_id}`) or give a local folder"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise MlxcelError(
            f"model.path={repo_id}: not in the Hugging Face cache ({HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; {fetch}"
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES))
    except Exception as exc:  # network, auth, missing repo: one line, whatever the cause
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MlxcelError(
            f"model.path={repo_id}: not in the Hugging Face cache ({HF_HUB_CACHE}) and the download failed ({reason}); "
            f"{fetch}"
        ) from exc
