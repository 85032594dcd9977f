"""The models a `--models-dir` holds, named and listed without reading them: each `.gguf` file
(a split model by its first part) by its file name less `.gguf`, each subdirectory holding a
`config.json` (a Hugging Face model directory) by its name. Only the directory's listing is
read; a model is opened when it is loaded."""

from __future__ import annotations

import re
from pathlib import Path

from probserve.models.errors import ModelLoadError

_LATER_PART = re.compile(r"-(\d{5})-of-\d{5}$")  # a split GGUF's part number in its stem


def models_in_dir(directory: str) -> dict[str, str]:
    """{name: path} of the models in `directory`, sorted by name; a ModelLoadError if it is
    not a readable directory."""
    root = Path(directory).expanduser()
    try:
        children = sorted(root.iterdir())
    except OSError as exc:
        raise ModelLoadError(f"--models-dir {directory}: {exc}") from exc
    found: dict[str, str] = {}
    for child in children:
        if child.name.startswith("."):
            continue
        if child.suffix == ".gguf" and child.is_file():
            part = _LATER_PART.search(child.stem)
            if part is not None and int(part.group(1)) != 1:
                continue
            found[child.stem] = str(child)
        elif child.is_dir() and (child / "config.json").is_file():
            found[child.name] = str(child)
    return found
