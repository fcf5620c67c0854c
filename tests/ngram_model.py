"""A tiny scripted model whose greedy reply to any chat is a fixed token sequence in which tokens
may repeat: each next token is decided by the current token and the `BACK` tokens before it.

tests/tool_model.py's scripted model decides the next token from the current one alone, so an
answer's tokens must be distinct; real reply syntaxes repeat tokens (Qwen3-Coder's XML writes `=`
and `>` for every argument, Qwen3 puts newlines around its thought). Here the weights are written,
not trained (one llama layer):

- every embedding is a constant channel, `BACK` empty slots and the token's code (the script's
  tokens get orthonormal codes, the rest random unit ones), all of one norm;
- attention head h attends to the token h + 1 places back: its query and key read only the
  constant channel, so RoPE makes their product a sum of cosines of the distance, peaked at
  h + 1 (`ROPE_THETA` below 1 spreads the frequencies so that no other distance comes close),
  and its value and output projections copy that token's code into slot h;
- the MLP's output projection is zero, so the last hidden state holds the context's codes;
- the head scores each successor by how much of its context matches, each token back weighing
  half the one after it, so the current token outweighs all the others together.

`write_weights` checks the result teacher-forced (one forward pass over prompt + answer) and
raises when a step's argmax is not the script's; `respell` splits tokens of an answer whose
context would be followed by two different tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, save_model

BACK = 3  # NOTE: tokens of context besides the current one
CODE = 39  # NOTE: dims per slot: at most this many distinct tokens in the script
HIDDEN = 160  # NOTE: 1 + (BACK + 1) * CODE, rounded up
HEAD_DIM = 64
HEADS = 4  # NOTE: BACK of them used; transformers wants the hidden size a multiple of them
ROPE_THETA = 0.5
CONFIG = {
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "num_hidden_layers": 1,
    "intermediate_size": 16,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "head_dim": HEAD_DIM,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": ROPE_THETA,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
# NOTE: residual layout: [constant | current code | code 1 back | ... | code BACK back | unused]
SLOTS = [slice(1 + n * CODE, 1 + (n + 1) * CODE) for n in range(BACK + 1)]
SCALE = float(np.sqrt(HIDDEN / 2))  # NOTE: constant and code this large: every rms is 1
WEIGHTS = [0.5**n for n in range(BACK + 1)]  # NOTE: current 1, then halves: it outweighs the rest
LOGIT = 12.0  # NOTE: the logit of a successor whose whole context matches, per unit of weight
SHARPNESS = 2.0  # NOTE: attention logit per frequency pair: the peak beats the rest by ~37
# NOTE: the final norm divides the residual (constant plus BACK + 1 codes) by its rms
FINAL_RMS = float(np.sqrt((BACK + 2) * SCALE**2 / HIDDEN))


def respell(prompt: Sequence[int], answer: list[int], eos: int, vocab: dict[str, int]) -> list[int]:
    """`answer` spelled so that no context is followed by two different tokens: where one is, a
    token of the later context is split in two (`vocab`: the tokens that may be split or be
    pieces); the text stays the same. Raises when no split helps."""
    answer = list(answer)
    names = {i: t for t, i in vocab.items()}
    lead = BACK + 1  # NOTE: chain index i is answer index i - lead
    for _ in range(len(answer) + 1):
        step = _conflict([*prompt[-lead:], *answer, eos])
        if step is None:
            return answer
        for at in range(step - lead, step - lead - BACK - 1, -1):
            pieces = _split(names.get(answer[at], ""), vocab) if at >= 0 else None
            if pieces:
                answer[at : at + 1] = pieces
                break
        else:
            raise ValueError(f"no spelling gives each context one successor (step {step})")
    raise ValueError("the answer could not be respelled")


def _conflict(chain: list[int]) -> int | None:
    """The chain index of the first token whose context was already followed by another."""
    seen: dict[tuple[int, ...], int] = {}
    for i in range(BACK, len(chain) - 1):
        if seen.setdefault(tuple(chain[i - BACK : i + 1]), chain[i + 1]) != chain[i + 1]:
            return i
    return None


def _split(name: str, vocab: dict[str, int]) -> list[int] | None:
    """Two tokens that spell the token `name`, the more even split first."""
    for cut in sorted(range(1, len(name)), key=lambda c: abs(len(name) - 2 * c)):
        if name[:cut] in vocab and name[cut:] in vocab:
            return [vocab[name[:cut]], vocab[name[cut:]]]
    return None


def write_weights(out: Path, prompt: Sequence[int], answer: Sequence[int], eos: int) -> None:
    """Script the model in `out` (built with `CONFIG`): after `prompt` it writes `answer`,
    then `eos`. Only the prompt's last `BACK + 1` tokens matter."""
    chain = [*prompt[-(BACK + 1) :], *answer, eos]
    model, _ = load_model(out)
    params = dict(tree_flatten(model.parameters()))
    vocab = params["model.embed_tokens.weight"].shape[0]
    codes = _codes(vocab, sorted(set(chain)))
    params["model.embed_tokens.weight"] = mx.array(_embeddings(codes))
    params.update(_attention())
    params["lm_head.weight"] = mx.array(_head(codes, chain))
    for name in params:
        if name.endswith("norm.weight"):
            params[name] = mx.ones(params[name].shape)
        elif name.endswith("down_proj.weight"):
            params[name] = mx.zeros(params[name].shape)
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    save_model(out, model)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    check(out, list(prompt), list(answer), eos)


def _codes(vocab: int, scripted: list[int]) -> np.ndarray:
    if len(scripted) > CODE:
        raise ValueError(f"{len(scripted)} distinct tokens in the script; at most {CODE}")
    rng = np.random.default_rng(0)
    codes = rng.normal(size=(vocab, CODE))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    ortho, _ = np.linalg.qr(rng.normal(size=(CODE, CODE)))
    codes[scripted] = ortho[: len(scripted)]
    return codes.astype(np.float32)


def _embeddings(codes: np.ndarray) -> np.ndarray:
    embed = np.zeros((codes.shape[0], HIDDEN), np.float32)
    embed[:, 0] = SCALE
    embed[:, SLOTS[0]] = SCALE * codes
    return embed


def _attention() -> dict[str, mx.array]:
    """Head h attends h + 1 tokens back and copies that token's code into slot h + 1."""
    half = HEAD_DIM // 2
    theta = ROPE_THETA ** (-np.arange(half) * 2 / HEAD_DIM)
    q = np.zeros((HEADS * HEAD_DIM, HIDDEN), np.float32)
    k, v = np.zeros_like(q), np.zeros_like(q)
    o = np.zeros((HIDDEN, HEADS * HEAD_DIM), np.float32)
    for h in range(BACK):
        rows = h * HEAD_DIM
        # NOTE: RoPE turns pair j of q.k into cos(phase_j + theta_j d) at distance d: peaked at
        # d = h + 1 with the phase -(h + 1) theta_j
        phase = -(h + 1) * theta
        q[rows : rows + half, 0] = SHARPNESS * np.cos(phase) / SCALE
        q[rows + half : rows + HEAD_DIM, 0] = SHARPNESS * np.sin(phase) / SCALE
        k[rows : rows + half, 0] = np.sqrt(HEAD_DIM) / SCALE  # NOTE: undoes the 1/sqrt(d)
        v[rows : rows + CODE, SLOTS[0]] = np.eye(CODE) / SCALE
        o[SLOTS[h + 1], rows : rows + CODE] = SCALE * np.eye(CODE)
    prefix = "model.layers.0.self_attn."
    weights = {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": o}
    return {f"{prefix}{name}.weight": mx.array(w) for name, w in weights.items()}


def _head(codes: np.ndarray, chain: list[int]) -> np.ndarray:
    """Each successor's row reads the codes of its contexts, slot by slot.

    NOTE: a token seen in one slot of several of a successor's contexts counts once, else a
    token that follows `":` twice would outscore, on `":` alone, the successor of a context
    that matches whole."""
    seen: dict[int, list[set[int]]] = {}
    for i in range(BACK, len(chain) - 1):
        slots = seen.setdefault(chain[i + 1], [set() for _ in SLOTS])
        for back, slot in enumerate(slots):
            slot.add(chain[i - back])
    head = np.zeros((codes.shape[0], HIDDEN), np.float32)
    unit = LOGIT * FINAL_RMS / SCALE
    for nxt, slots in seen.items():
        for weight, where, toks in zip(WEIGHTS, SLOTS, slots, strict=True):
            head[nxt, where] = unit * weight * codes[sorted(toks)].sum(axis=0)
    return head


def check(out: Path, prompt: list[int], answer: list[int], eos: int) -> None:
    """Teacher-forced: after `prompt` and each answer prefix the argmax is the script's next."""
    model, _ = load_model(out)
    logits = model(mx.array([prompt + answer]))[0]
    got = np.array(mx.argmax(logits[len(prompt) - 1 :], axis=-1)).tolist()
    if got != [*answer, eos]:
        raise AssertionError(f"the scripted model writes {got}, not {[*answer, eos]}")
