"""Small helpers the checkpoint readers share (not a reader itself)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

from ..errors import CheckpointError

# Far above any model this kit will meet, far below sizes that would wrap an int32
# or make the size arithmetic meaningless. They exist to reject garbage headers early
# (llama2.c's seven header ints, GGUF's llama.* metadata).
LIMITS = {"dim": 65536, "hidden_dim": 1 << 20, "n_layers": 4096, "n_heads": 4096,
          "n_kv_heads": 4096, "vocab_size": 1 << 24, "max_seq_len": 1 << 24}


def read_json_object(path: Path) -> Dict[str, Any]:
    """The JSON object in a file, or a CheckpointError saying why there is none."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read JSON file {path}: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value
