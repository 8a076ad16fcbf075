"""The planner's JSON files (profiles, plans, search results), written whole: through a
temporary file beside the target, then renamed, so that a reader (another ``serve`` starting
from the profile cache) sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        f.write(json.dumps(doc, indent=2) + "\n")
    os.replace(f.name, path)
