"""The top floor: what assembles the processes. The CLI (`mlx-engine`), the launcher that starts,
watches and stops them, the in-process and offline engines (the same parts without processes),
and `mlx-engine bench`. It imports every floor below; nothing below imports it
(docs/architecture.md, "Floors")."""
