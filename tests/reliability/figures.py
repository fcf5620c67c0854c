"""The reliability suite's figures (what it must show), printed at the end of the run.

Set MLX_ENGINE_SOAK=SECONDS for the longer soak: the storm and the hostile phase then run that
long (the hostile phase at most a minute) and the fuzzer sends proportionally more frames.
"""

from __future__ import annotations

import os
from typing import Any

SOAK_S = float(os.environ.get("MLX_ENGINE_SOAK", "0"))
FIGURES: dict[str, Any] = {}
