"""`mlx-engine` command line: launch, supervisor-conf, convert (and later bench)."""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path
from typing import Any

import click

from engine.client import API_KEY_ENV
from engine.config import EngineConfig


def _config_options(func: Any) -> Any:
    """Add one click option per EngineConfig field, so the CLI always mirrors the config."""
    hints = typing.get_type_hints(EngineConfig)
    for f in reversed(EngineConfig.option_fields()):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            option = click.option(flag, is_flag=True, default=f.default, help=f.metadata["help"])
        else:
            click_type = {int: int, float: float}.get(kind, str)
            option = click.option(
                flag, type=click_type, default=f.default, show_default=True, help=f.metadata["help"]
            )
        func = option(func)
    return func


@click.group()
@click.version_option(package_name="mlx-engine")
def main() -> None:
    """mlx-engine: serve large language models on MLX."""


@main.command()
@_config_options
def launch(**options: Any) -> None:
    """Start the engine in the foreground (tokenizer, scheduler and detokenizer processes)."""
    # NOTE: the environment keeps the key out of `ps` output; the flag wins when both are set.
    options["api_key"] = options["api_key"] or os.environ.get(API_KEY_ENV) or None
    try:
        config = EngineConfig(**options).validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        from engine.launch import run_engine
    except ImportError:
        click.echo("mlx-engine launch: the multi-process engine is not available yet", err=True)
        sys.exit(2)
    sys.exit(run_engine(config))


@main.command("supervisor-conf")
@_config_options
@click.option("--name", default="mlx-engine", show_default=True, help="supervisord program name")
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/var/log/mlx-engine"),
    show_default=True,
    help="Directory of the engine's log file (rotated by supervisord)",
)
@click.option("--startsecs", type=int, default=10, show_default=True, help="supervisord startsecs")
def supervisor_conf(name: str, log_dir: Path, startsecs: int, **options: Any) -> None:
    """Print a supervisord [program] section that runs `launch` with these options."""
    from engine.supervisor_conf import program_section

    try:
        config = EngineConfig(**options).validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    click.echo(program_section(config, name, log_dir, startsecs), nl=False)


@main.command()
@click.argument("src", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Output directory")
def convert(src: Path | None, out: Path | None) -> None:
    """Convert a GGUF file (default: the embedded SmolLM2-135M) to an MLX model directory."""
    from engine.errors import ModelError
    from engine.models import convert_to_mlx

    try:
        out_dir = convert_to_mlx(src, out)
    except ModelError as e:
        raise click.ClickException(str(e)) from e
    click.echo(str(out_dir))


if __name__ == "__main__":
    main()
