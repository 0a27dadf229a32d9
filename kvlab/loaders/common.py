"""Small helpers the checkpoint readers share (not a reader itself)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

from ..errors import CheckpointError


def read_json_object(path: Path) -> Dict[str, Any]:
    """The JSON object in a file, or a CheckpointError saying why there is none."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read JSON file {path}: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value
