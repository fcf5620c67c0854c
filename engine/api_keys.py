"""Client API keys (`--api-keys-file`): each key is a client of its own.

A key is the unit of fair admission (docs/operations.md, "Fair admission"): behind a proxy every
request comes from one address and an SDK user may open many connections, while a key names
whom the operator serves. `--api-key` stays the owner's key, the only one that may also stop
the engine or read its stats; the keys of this file only generate.

The file: one client per line, `NAME KEY` (the name is what logs and errors show, never the
key) or just `KEY` (named `key-LINE`); blank lines and `#` comments are skipped.
"""

from __future__ import annotations

from pathlib import Path

OWNER = "owner"  # the client name of `--api-key`


def load(path: str | Path) -> dict[str, str]:
    """key -> client name; a ValueError naming the file and line for anything malformed."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-keys-file {path}: cannot read it ({e})") from e
    keys: dict[str, str] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, key = _parse(line, number, path)
        if key in keys or name in names or name == OWNER:
            what = "key" if key in keys else f"name {name!r}"
            raise ValueError(f"--api-keys-file {path}, line {number}: the {what} is taken")
        keys[key] = name
        names.add(name)
    if not keys:
        raise ValueError(f"--api-keys-file {path}: no keys in it")
    return keys


def _parse(line: str, number: int, path: str | Path) -> tuple[str, str]:
    parts = line.split()
    if len(parts) > 2:
        raise ValueError(f"--api-keys-file {path}, line {number}: expected `NAME KEY` or `KEY`")
    name, key = (f"key-{number}", parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    if len(key) < 8:
        raise ValueError(f"--api-keys-file {path}, line {number}: a key needs 8+ characters")
    return name, key
