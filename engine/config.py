"""The one frozen configuration of an engine.

Every CLI option of `mlx-engine launch` is generated from a field here (see `mlx_engine.cli`), and
`validate()` is the one place that checks them. "auto" and 0 values stay in the config: the part
that knows the device resolves them (KV budget: scheduler_proc/kv_budget.py; prefill sizes:
scheduler_proc/backend.py; BLAS and dequantize: engine/cpu_backend.py,
engine/cpu_dequantize.py; warm-up: the scheduler).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from engine import api_keys

ON_OFF_AUTO = ("auto", "on", "off")


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _opt(
        None,
        "A model directory, a .gguf file or a Hugging Face name ORG/NAME[@REVISION] (its cache, "
        "HF_TOKEN and HF_HUB_OFFLINE apply); default: embedded SmolLM2-135M",
    )
    gguf_file: str | None = _opt(
        None, "Which .gguf file of a Hugging Face GGUF repository --model names (else its only one)"
    )
    adapter_path: str | None = _opt(
        None,
        "A LoRA adapter directory (mlx-lm's format: adapter_config.json, adapters.safetensors) "
        "applied at load; adapters can also be loaded and unloaded while running",
    )
    host: str = _opt("127.0.0.1", "Host the client endpoints bind to")
    zmq_port: int = _opt(30001, "Port of the ZeroMQ SDK endpoint")
    port: int = _opt(30000, "Port of the OpenAI-compatible HTTP API")
    # NOTE: repr=False: a config that gets logged never shows the key.
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata={"help": "Key every HTTP and ZMQ client must present [env MLX_ENGINE_API_KEY]"},
    )
    api_keys_file: str | None = _opt(
        None,
        "File of client API keys, a line each (`NAME KEY`): each key is a client of its own for "
        "fair admission; --api-key stays the owner's key (the one that may stop the engine)",
    )
    trusted_proxies: str = _opt(
        "",
        "Comma-separated addresses of HTTP proxies whose X-Forwarded-For names the client "
        "(fair admission); elsewhere the client is the peer address",
    )
    max_running_requests: int = _opt(
        0,
        "Most requests running at once; 0: what the KV budget holds at 2048 tokens a request, "
        "at most 256 (KV pages follow the tokens each request holds)",
    )
    chunked_prefill_size: int = _opt(
        0, "Prompt tokens per request per prefill step; 0: 2048 on CUDA and Metal, 512 on the CPU"
    )
    max_prefill_tokens: int = _opt(
        0,
        "Most (padded) prompt tokens in one prefill step; "
        "0: 8192 on CUDA, 2048 on Metal, 512 on the CPU",
    )
    long_prefill_scores: int = _opt(
        0,
        "While requests decode, most attention scores per head (rows x chunk x keys) of a prefill "
        "step reading more keys than --chunked-prefill-size (a long prompt's later chunks), so "
        "decoding requests keep their pace; 0: 2097152 on CUDA, no cap on Metal and the CPU",
    )
    long_prefill_chunk: int = _opt(
        0,
        "A long prompt's later chunks: tokens per step of their own, whose keys end on a multiple "
        "of it, attended by the fast op's causal kernel (no mask, no scores held, few shapes); "
        "while requests decode its first chunk too runs alone, this many tokens; "
        "0: 512 on CUDA for attention-only bf16/f16 models, off elsewhere; -1: off",
    )
    max_total_tokens: int = _opt(0, "KV cache capacity in tokens (0: derive from --mem-fraction)")
    context_length: int = _opt(
        0, "Most tokens (prompt + generated) per request; 0: the model's own limit"
    )
    page_size: int = _opt(32, "Tokens per KV page (a request holds whole pages)")
    kv_bits: int = _opt(
        0,
        "Quantize full-attention KV pages to 8 or 4 bits (MLX's affine groups): the same budget "
        "holds ~1.9x / ~3.5x the tokens; 0: the model's dtype",
    )
    kv_group_size: int = _opt(64, "Values per scale and bias of --kv-bits (32, 64 or 128)")
    mem_fraction: float = _opt(0.5, "Fraction of free device memory for the KV cache")
    max_queued_requests: int = _opt(1024, "Requests waiting beyond this get Overloaded")
    disable_overlap: bool = _opt(False, "Run the synchronous loop instead of the overlap loop")
    disable_radix_cache: bool = _opt(False, "Turn off the radix prefix cache (reuse of shared KV)")
    kv_cache_dir: str | None = _opt(
        None,
        "A folder for the prefix cache's disk tier: finished requests' KV is written there in "
        "blocks of 64 tokens (in the background), and a prompt whose prefix is there loads it "
        "instead of computing it, after a restart too; off by default",
    )
    kv_cache_disk_gb: float = _opt(
        16.0, "Most gigabytes --kv-cache-dir holds; least recently used blocks go first"
    )
    kv_events_endpoint: str | None = _opt(
        None,
        "Publish the prefix cache's KV events (vLLM's ZMQ format: BlockStored, BlockRemoved, "
        "AllBlocksCleared) for KV-aware routers: tcp://*:PORT and ipc://PATH bind, "
        "tcp://HOST:PORT connects to a subscriber that binds; off by default",
    )
    kv_events_replay_endpoint: str | None = _opt(
        None, "Where subscribers ask for missed KV event batches (bound), e.g. tcp://*:5558"
    )
    kv_events_topic: str = _opt("", "The topic frame of every KV event message")
    kv_events_format: str = _opt(
        "array",
        "KV events' layout: array (each event a positional array, vLLM's first layout) or map "
        "(each event a map, vLLM's later one)",
    )
    cpu_blas: str = _opt("auto", "Linux CPU BLAS: auto (OpenBLAS if found), reference, or a path")
    cpu_dequantize: str = _opt("auto", "CPU: dequantize weights to float32 at load: auto, on, off")
    warmup: str = _opt(
        "auto",
        "Run every bucketed step shape once before READY: auto (on CUDA; elsewhere one small "
        "forward of each kind), on, off",
    )
    fused_decode: str = _opt(
        "auto",
        "Decode attention over rows of any length in one fused kernel: auto (on CUDA, whose own "
        "kernel takes no mask), on, off (MLX's attention with a per-row mask)",
    )
    prefill_in_chain: str = _opt(
        "auto",
        "Prompt chunks ride chained decode steps (a prefill step queued beside each, so the "
        "overlap loop keeps chaining while prompts prefill, and waiting requests are seated "
        "while a step is in flight): auto (off: on a GPU, 128 agents ran 1.2x faster without), "
        "on, off (decode and prefill steps take turns, unchained)",
    )
    reasoning_parser: str = _opt(
        "auto",
        "A thinking model's thought apart from its answer on the HTTP APIs (reasoning_content, "
        "thinking blocks, reasoning items): auto (gpt-oss's harmony channels when the model "
        "speaks harmony, else the tokenizer's think markers, when it has them), harmony, none "
        "(the thought stays in the text)",
    )
    prefill_attention: str = _opt(
        "auto",
        "Prompt-chunk attention: auto (ops on CUDA, whose masked fast kernel builds per shape), "
        "ops (MLX's matmul and softmax), fast (mx.fast.scaled_dot_product_attention)",
    )
    spec: str = _opt(
        "off",
        "Speculative decoding: off, auto (ngram on one device for a model whose KV can be "
        "rolled back, else off), ngram (prompt lookup: a row, greedy or sampled, proposes what "
        "followed its last n tokens earlier in its prompt or output), draft (a smaller model "
        "with the same tokenizer proposes, --draft-model); verified in the decode step",
    )
    draft_model: str | None = _opt(
        None, "The draft model of --spec draft: a directory or ORG/NAME, the model's tokenizer"
    )
    spec_k: int = _opt(8, "Most tokens a row proposes a step (--spec); its own k adapts")
    spec_ngram: int = _opt(3, "Longest n-gram --spec ngram matches (then shorter, down to 2)")
    spec_max_rows: int = _opt(
        8,
        "Most decoding rows a step may have and still speculate (--spec): a larger batch is "
        "compute-bound, and a speculating row breaks the overlap chain",
    )
    shutdown_grace: float = _opt(10.0, "Seconds running requests may finish after a shutdown")
    max_frame_bytes: int = _opt(
        8 << 20, "Largest client frame (bytes); 4x this drops the connection"
    )
    max_body_bytes: int = _opt(8 << 20, "Largest HTTP request body (bytes); beyond it, 413")
    http_max_connections: int = _opt(
        0, "Most open HTTP connections; 0: the open-file limit less 512 (at most 65536)"
    )
    http_max_connections_per_peer: int = _opt(
        1024, "Most open HTTP connections from one address (0: no cap)"
    )
    http_keepalive_timeout: float = _opt(
        30.0, "Seconds an idle keep-alive HTTP connection stays open"
    )
    max_prompt_chars: int = _opt(
        1_000_000, "Most characters in a prompt, or in all its messages and tools"
    )
    max_messages: int = _opt(1024, "Most chat messages in one request")
    max_stop_strings: int = _opt(16, "Most stop strings (and stop token ids) per request")
    max_stop_chars: int = _opt(256, "Longest stop string (characters)")
    max_nesting_depth: int = _opt(32, "Deepest nesting of lists and maps in messages and params")
    client_share: float = _opt(
        0.5,
        "Fraction of admission (running + queued requests) one client may hold: an API key of "
        "--api-keys-file, else an HTTP peer address or an SDK connection",
    )
    client_timeout: float = _opt(
        30.0,
        "Seconds a client connection may stay silent (stopped, unplugged) before it is "
        "dropped and its requests aborted",
    )
    seed: int = _opt(0, "Seed of the engine's default random state")
    log_level: str = _opt("info", "Log level: debug, info, warning, error")
    startup_timeout: float = _opt(300.0, "Seconds each engine process may take to become ready")
    tp: int = _opt(
        1,
        "Tensor-parallel ranks on this host (N GPUs, or N CPU processes); see docs/distributed.md",
    )
    tp_hostfile: str | None = _opt(
        None,
        'Multi-host tensor parallel: JSON list of each rank\'s ["ip:port"] (MLX ring hostfile)',
    )
    tp_rank: int = _opt(
        0, "Multi-host: this host's rank; 0 serves clients, others run a scheduler worker only"
    )
    tp_backend: str = _opt(
        "auto", "MLX distributed backend: auto (nccl on CUDA, else ring), ring, nccl"
    )
    tp_frames: str = _opt(
        "tcp",
        "How rank 0's commands reach the other tensor-parallel ranks each iteration: tcp (a "
        "host socket to each rank, off the device) or collective (an all_sum on the group)",
    )
    tp_step_timeout: float = _opt(
        20.0,
        "Seconds a tensor-parallel rank may go without a step before the engine stops (longer "
        "than the longest step)",
    )
    tp_init_timeout: float = _opt(60.0, "Seconds the tensor-parallel group may take to form")

    def validate(self) -> EngineConfig:
        # NOTE: max_queued_requests 0 would refuse every request as Overloaded.
        positive = (
            "page_size",
            "max_queued_requests",
            "max_frame_bytes",
            "max_body_bytes",
            "max_prompt_chars",
            "max_messages",
            "max_stop_strings",
            "max_stop_chars",
            "max_nesting_depth",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        auto = ("chunked_prefill_size", "max_prefill_tokens", "max_running_requests")
        for name in (*auto, "long_prefill_scores"):
            # NOTE: 0 is "auto"
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.long_prefill_chunk < -1:
            raise ValueError(f"long_prefill_chunk must be >= -1, got {self.long_prefill_chunk}")
        if self.context_length < 0:
            raise ValueError("context_length must be >= 0")
        if self.max_total_tokens < 0:
            raise ValueError("max_total_tokens must be >= 0")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        for name in ("http_max_connections", "http_max_connections_per_peer"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.http_keepalive_timeout <= 0:
            raise ValueError(
                f"http_keepalive_timeout must be > 0, got {self.http_keepalive_timeout}"
            )
        if self.client_timeout <= 0:
            raise ValueError(f"client_timeout must be > 0, got {self.client_timeout}")
        if not 0.0 < self.client_share <= 1.0:
            raise ValueError(f"client_share must be in (0, 1], got {self.client_share}")
        if self.startup_timeout <= 0:
            raise ValueError("startup_timeout must be > 0")
        if self.shutdown_grace < 0:
            raise ValueError("shutdown_grace must be >= 0")
        for name in ("zmq_port", "port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"{name} must be a TCP port, got {getattr(self, name)}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(
                f"log_level must be debug, info, warning or error, got {self.log_level}"
            )
        for name in ("warmup", "fused_decode", "prefill_in_chain"):
            if getattr(self, name) not in ON_OFF_AUTO:
                raise ValueError(f"{name} must be auto, on or off, got {getattr(self, name)}")
        if self.reasoning_parser not in ("auto", "harmony", "none"):
            raise ValueError(
                f"reasoning_parser must be auto, harmony or none, got {self.reasoning_parser}"
            )
        sizes = (self.spec_k, self.spec_ngram, self.spec_max_rows)
        if self.spec not in ("auto", "off", "ngram", "draft") or min(sizes) < 1:
            raise ValueError(
                "spec must be auto, off, ngram or draft, and spec_k, spec_ngram and "
                f"spec_max_rows >= 1, got {self.spec}, {sizes}"
            )
        if (self.spec == "draft") != bool(self.draft_model):
            raise ValueError("--spec draft and --draft-model go together: a draft model drafts")
        if self.spec in ("ngram", "draft") and self.tp > 1:
            # NOTE: which rows speculate follows each rank's own step times (the pay rule), so
            # ranks disagree on a step's rows and the next collective hangs: with --tp 2 --spec
            # ngram a rank stalled 20 s and the engine died
            raise ValueError(f"--spec {self.spec} runs on one device: not with --tp")
        if self.prefill_attention not in ("auto", "ops", "fast"):
            raise ValueError(
                f"prefill_attention must be auto, ops or fast, got {self.prefill_attention}"
            )
        if not (self.api_key or self.api_keys_file) and not _loopback(self.host):
            raise ValueError(
                f"--host {self.host} accepts clients from other machines: set --api-key (or "
                "MLX_ENGINE_API_KEY, or --api-keys-file) so they must present a key, or bind "
                "127.0.0.1"
            )
        if self.api_keys_file:
            api_keys.load(self.api_keys_file)  # NOTE: a bad file is found before a model loads
        for proxy in filter(None, (p.strip() for p in self.trusted_proxies.split(","))):
            try:
                ipaddress.ip_address(proxy)
            except ValueError:
                raise ValueError(f"trusted_proxies: {proxy!r} is not an IP address") from None
        if self.tp < 1 or self.tp_rank < 0:
            raise ValueError(f"tp must be >= 1 and tp_rank >= 0, got {self.tp}, {self.tp_rank}")
        if self.tp_rank > 0 and not self.tp_hostfile:
            raise ValueError("--tp-rank needs --tp-hostfile (the ranks of every host)")
        if self.tp_backend not in ("auto", "ring", "nccl"):
            raise ValueError(f"tp_backend must be auto, ring or nccl, got {self.tp_backend}")
        if self.tp_frames not in ("tcp", "collective"):
            raise ValueError(f"tp_frames must be tcp or collective, got {self.tp_frames}")
        if self.tp_step_timeout <= 0 or self.tp_init_timeout <= 0:
            raise ValueError("tp_step_timeout and tp_init_timeout must be > 0")
        if self.adapter_path:
            _check_adapter_dir(self.adapter_path)
            if self.tp > 1 or self.tp_hostfile:
                raise ValueError("--adapter-path with tensor parallel is not supported yet")
        self._check_kv_events()
        self._check_kv_cache_dir()
        if self.kv_bits not in (0, 4, 8) or self.kv_group_size not in (32, 64, 128):
            raise ValueError(
                f"kv_bits must be 0, 4 or 8 and kv_group_size 32, 64 or 128, got {self.kv_bits}, "
                f"{self.kv_group_size}"
            )
        if self.cpu_dequantize not in ON_OFF_AUTO:
            raise ValueError(f"cpu_dequantize must be auto, on or off, got {self.cpu_dequantize}")
        return self

    def _check_kv_cache_dir(self) -> None:
        if self.kv_cache_disk_gb <= 0:
            raise ValueError(f"kv_cache_disk_gb must be > 0, got {self.kv_cache_disk_gb}")
        if not self.kv_cache_dir:
            return
        if self.disable_radix_cache:
            raise ValueError("--kv-cache-dir is the radix cache's disk tier: not with it off")
        if self.tp > 1 or self.tp_hostfile:
            raise ValueError("--kv-cache-dir with tensor parallel is not supported yet")
        import os
        from pathlib import Path

        folder = Path(self.kv_cache_dir).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_cache_dir: cannot make {folder}: {e.strerror}") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"kv_cache_dir: {folder} is not writable by this user")

    def _check_kv_events(self) -> None:
        if self.kv_events_format not in ("array", "map"):
            raise ValueError(f"kv_events_format must be array or map, got {self.kv_events_format}")
        if not self.kv_events_endpoint:
            if self.kv_events_replay_endpoint:
                raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
            return
        if self.disable_radix_cache:
            raise ValueError("--kv-events-endpoint needs the radix cache (its events)")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"{name} must be a tcp://, ipc:// or inproc:// address, got {value}"
                )

    @classmethod
    def option_fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))


# NOTE: an mlx-lm adapter directory's files (scheduler_proc/weights.py loads them)
ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def _check_adapter_dir(path: str) -> None:
    from pathlib import Path

    for name in ADAPTER_FILES:
        if not (Path(path).expanduser() / name).is_file():
            raise ValueError(f"adapter_path: {path} has no {name} (an mlx-lm adapter directory)")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # NOTE: a host name other than localhost may resolve anywhere
