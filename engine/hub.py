"""Models by their Hugging Face name: `--model ORG/NAME[@REVISION]` (mlx_lm.server, LM Studio and
vllm-mlx all take one).

Resolved through huggingface_hub, so its cache (`HF_HOME`, `HF_HUB_CACHE`), `HF_TOKEN` and
`HF_HUB_OFFLINE` work as everywhere else; a download reports its progress (engine/progress.py: a
bar on a terminal, a line every LOG_EVERY_S in a log) and logs its size and time. Only
what a model directory needs is fetched (configs, safetensors weights, tokenizer files), never a
repository's other formats. A GGUF repository gives its one `.gguf` file, or the one named by
`--gguf-file`, which the caller converts (engine/models.py). Every failure is a `ModelError`
that names the model and what to do.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.errors import ModelError
from engine.progress import Progress

# NOTE: ORG/NAME as the Hub spells repository ids, an optional @REVISION (branch, tag, commit)
NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?")
LOG_EVERY_S = 5.0
log = logging.getLogger("hub")
PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]


def is_hub_name(model: str) -> bool:
    """`ORG/NAME[@REVISION]` that is not a path on this machine (a path always wins)."""
    return NAME.fullmatch(model) is not None and not Path(model).expanduser().exists()


def repo_of(model: str) -> str:
    return model.partition("@")[0]


def resolve(model: str, gguf_file: str | None = None) -> Path:
    """A local model directory for `model`, or its GGUF file (downloaded when allowed)."""
    from huggingface_hub import errors

    repo, _, revision = model.partition("@")
    try:
        if gguf_file:
            return _file(repo, gguf_file, revision or None)
        path = _snapshot(repo, revision or None)
        if (path / "config.json").is_file():
            return path
        return _single_gguf(repo, revision or None, path)
    except errors.GatedRepoError:
        raise ModelError(
            f"{repo} is gated: accept its terms at https://huggingface.co/{repo}, then set "
            "HF_TOKEN (or `huggingface-cli login`)"
        ) from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        raise ModelError(
            f"{model} is not in the Hugging Face cache ({_cache_dir()}) and downloads are off "
            "(HF_HUB_OFFLINE): download it first (`huggingface-cli download "
            f"{repo}`), or unset HF_HUB_OFFLINE"
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelError(f"{repo} has no revision {revision!r}") from None
    except errors.RepositoryNotFoundError:
        raise ModelError(
            f"{repo}: no such model on the Hugging Face Hub (a private one needs HF_TOKEN)"
        ) from None
    except errors.EntryNotFoundError:
        raise ModelError(f"{repo} has no file {gguf_file!r} (--gguf-file)") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise ModelError(f"{model}: cannot fetch it from the Hugging Face Hub: {e}") from None


def _snapshot(repo: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    with _reported(f"download {repo}") as bar:
        return Path(
            snapshot_download(repo, revision=revision, allow_patterns=PATTERNS, tqdm_class=bar)
        )


def _file(repo: str, name: str, revision: str | None) -> Path:
    from huggingface_hub import hf_hub_download

    with _reported(f"download {name}") as bar:
        return Path(hf_hub_download(repo, name, revision=revision, tqdm_class=bar))


@contextmanager
def _reported(what: str) -> Iterator[Any]:
    """A tqdm class for one download; when it ends, the bytes it wrote and its time are logged
    (nothing when everything was cached)."""
    shown: list[Progress] = []
    try:
        yield progress_bar(what, shown)
        for progress in shown:
            if progress.total > 0:
                progress.finish()
    finally:
        for progress in shown:
            progress.close()  # NOTE: huggingface_hub leaves some of its bars open


def progress_bar(what: str, shown: list[Progress]) -> Any:
    """A tqdm class for huggingface_hub: its bar of bytes written to the cache becomes a
    `Progress` (a bar on a terminal, a line every LOG_EVERY_S in a log), added to `shown`; its
    other bars (files fetched, bytes received over the network) are drawn nowhere, so one line
    says how far the download got."""
    from huggingface_hub.utils import tqdm

    class Bar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.progress: Progress | None = None
            name = kwargs.get("name") or ""
            if kwargs.get("unit") == "B" and not name.endswith(".transfer"):
                total = int(kwargs.get("total") or 0)
                self.progress = Progress(log, what, total, "B", LOG_EVERY_S)
                shown.append(self.progress)
            kwargs["file"] = io.StringIO()  # NOTE: tqdm draws nowhere; `display` reports
            if kwargs.get("disable") is None:
                # NOTE: "auto" would turn tqdm off, its file being no terminal; off it counts
                # nothing. HF_HUB_DISABLE_PROGRESS_BARS still turns it off (disable=True).
                kwargs["disable"] = False
            super().__init__(*args, **kwargs)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            if self.progress is not None:
                self.progress.update(int(self.n), int(self.total or 0))
            return True

        def close(self) -> None:
            super().close()
            if self.progress is not None:
                self.progress.close()

    return Bar


def _single_gguf(repo: str, revision: str | None, snapshot: Path) -> Path:
    """A repository without config.json: its one GGUF file (the Hub's list, or offline the
    cached ones)."""
    from huggingface_hub import constants, list_repo_files

    if constants.HF_HUB_OFFLINE:
        names = sorted(p.name for p in snapshot.glob("*.gguf"))
    else:
        names = sorted(n for n in list_repo_files(repo, revision=revision) if n.endswith(".gguf"))
    if len(names) == 1:
        return _file(repo, names[0], revision)
    if not names:
        raise ModelError(f"{repo}: neither an MLX model (no config.json) nor a GGUF repository")
    listed = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    raise ModelError(f"{repo} has {len(names)} GGUF files; pick one with --gguf-file: {listed}")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
