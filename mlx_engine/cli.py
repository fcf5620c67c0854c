"""`mlx-engine` command line: launch, supervisor-conf, convert, bench."""

from __future__ import annotations

import os
import shlex
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
    from mlx_engine.launch import run_engine

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
@click.option(
    "--workers",
    type=int,
    default=1,
    show_default=True,
    help="Engines on this host, on consecutive ports from --port (and --zmq-port); more than one "
    "writes a supervisord group",
)
@click.option(
    "--router",
    type=click.Choice(["none", "smg"]),
    default="none",
    show_default=True,
    help="smg: Shepherd Model Gateway in front of the engines, routing by prefix-cache affinity",
)
@click.option("--router-port", type=int, default=8000, show_default=True, help="smg's port")
@click.option(
    "--remote-workers",
    default="",
    help="Engines on other hosts that smg routes to as well: http://HOST:PORT, comma-separated",
)
def supervisor_conf(
    name: str,
    log_dir: Path,
    startsecs: int,
    workers: int,
    router: str,
    router_port: int,
    remote_workers: str,
    **options: Any,
) -> None:
    """Print a supervisord [program] section that runs `launch` with these options; with
    --workers N or --router smg, a group: N engines and smg in front of them."""
    from mlx_engine.supervisor_conf import Fleet, fleet_conf, program_section

    remote = tuple(u.strip() for u in remote_workers.split(",") if u.strip())
    try:
        config = EngineConfig(**options).validate()
        if workers == 1 and router == "none" and not remote:
            text = program_section(config, name, log_dir, startsecs)
        else:
            fleet = Fleet(workers, router, router_port, remote)
            text = fleet_conf(config, fleet, name, log_dir, startsecs)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    click.echo(text, nl=False)


@main.command()
@click.argument("src", required=False)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Output directory")
@click.option("--gguf-file", help="Which .gguf file of a Hugging Face repository SRC names")
def convert(src: str | None, out: Path | None, gguf_file: str | None) -> None:
    """Convert a GGUF file, or a Hugging Face GGUF repository ORG/NAME[@REVISION] (default: the
    embedded SmolLM2-135M), to an MLX model directory; prints the directory."""
    import logging

    from engine import hub
    from engine.errors import ModelError
    from engine.models import convert_to_mlx

    # NOTE: what it does and how long it took on stderr (a bar there on a terminal); stdout holds
    # only the directory, for scripts.
    logging.basicConfig(stream=sys.stderr, level="INFO", format="%(asctime)s %(message)s")
    try:
        path = Path(src) if src is not None else None
        if src is not None and hub.is_hub_name(src):
            path = hub.resolve(src, gguf_file)
        # NOTE: a Hugging Face MLX model is a model directory already: nothing to convert
        out_dir = path if path is not None and path.is_dir() else convert_to_mlx(path, out)
    except ModelError as e:
        raise click.ClickException(str(e)) from e
    click.echo(str(out_dir))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str | None) -> tuple[float, ...]:
    return tuple(float(x) for x in (text or "").split(",") if x.strip())


@main.command(context_settings={"show_default": True})
@click.option("--url", help="Measure a running OpenAI-compatible server (http://host:port).")
@click.option(
    "--launch", "launch_", is_flag=True, help="Start this engine (the default w/o --url)."
)
@click.option("--model", help="Model dir or .gguf for started servers (default: SmolLM2-135M).")
@click.option("--launch-args", default="", help="Extra `mlx-engine launch` options, one string.")
@click.option(
    "--launch-log",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Engine log (default: OUT/mlx-engine.log; a peer's: OUT/mlx_lm.log).",
)
@click.option(
    "--compare",
    default="",
    help="Also start and measure a peer: mlx-lm (as shipped, and on Linux CPU also in the "
    "engine's BLAS + float32 environment), or mlx-lm-env (only the latter).",
)
@click.option("--workload", default="random", type=click.Choice(["random", "jsonl", "multiturn"]))
@click.option("--dataset", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--num-requests", default=64, help="Requests per load level.")
@click.option("--input-len", default="64:256", help="Prompt words: N or LOW:HIGH.")
@click.option("--output-len", default="64", help="max_tokens: N or LOW:HIGH.")
@click.option("--turns", default=3, help="multiturn: turns per user.")
@click.option("--system-len", default=512, help="multiturn: words of the shared system prompt.")
@click.option("--concurrency", default="1,4,16,64", help="Closed-loop sweep, comma list.")
@click.option("--request-rate", help="Poisson arrivals per second, comma list (replaces sweep).")
@click.option("--seed", default=0)
@click.option("--ignore-eos/--no-ignore-eos", default=True, help="Fixed output lengths.")
@click.option("--out", "out_dir", default="bench-results", type=click.Path(path_type=Path))
@click.option("--progress/--no-progress", default=True)
def bench(**o: Any) -> None:
    """Load-test this engine (or any OpenAI-compatible server) over streaming HTTP."""
    from mlx_engine.bench.run import BenchConfig, run_bench

    if o.pop("launch_") and o["url"]:
        raise click.UsageError("--launch and --url exclude each other")
    try:
        config = BenchConfig(
            **o
            | {
                "launch_args": tuple(shlex.split(o["launch_args"])),
                "compare": tuple(x for x in o["compare"].split(",") if x),
                "concurrency": _ints(o["concurrency"]),
                "request_rate": _floats(o["request_rate"]),
            }
        ).validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    run_bench(config)


if __name__ == "__main__":
    main()
