"""End to end through `mlx-engine launch` on the embedded default model (SmolLM2-135M)."""

from __future__ import annotations

import pytest
from engine_harness import LaunchedEngine, bounded  # noqa: F401
from mlx_lm.generate import generate

from engine.client import EngineClient
from engine.models import load

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("bounded")]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    engine = LaunchedEngine(None, tmp_path_factory.mktemp("default") / "launch.log").wait_ready()
    yield engine.address
    engine.stop()


def test_chat_answer_matches_mlx_lm(address):
    model, tokenizer = load(None)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected = generate(model, tokenizer, prompt, max_tokens=16)
    with EngineClient(address) as c:
        r = c.generate(messages=MESSAGES, max_tokens=16, temperature=0.0)
        streamed = "".join(
            ch.text for ch in c.stream(messages=MESSAGES, max_tokens=16, temperature=0.0)
        )
    assert r.text == expected == streamed
    assert "Paris" in r.text


def test_stop_string_on_real_text(address):
    with EngineClient(address) as c:
        full = c.generate(messages=MESSAGES, max_tokens=16, temperature=0.0).text
        r = c.generate(messages=MESSAGES, max_tokens=16, temperature=0.0, stop=["Paris"])
    assert r.finish_reason == "stop" and r.text == full[: full.index("Paris")]
