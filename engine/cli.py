"""`python -m engine.cli`: the CLI's old address, kept for supervisor configurations written before
it moved to the top floor (mlx_engine/cli.py); `mlx-engine supervisor-conf` writes the new one.
Nothing imports this module: run as a script, it runs mlx_engine.cli (by name, so the ground floor
has no import of the floor above; docs/architecture.md, "Floors")."""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("mlx_engine.cli", run_name="__main__", alter_sys=True)
