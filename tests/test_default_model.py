"""End to end on the real default model (SmolLM2-135M-Instruct from its GGUF)."""

from __future__ import annotations

import pytest
from mlx_lm.generate import generate

from engine.models import load


@pytest.mark.slow
def test_greedy_answer_names_paris():
    model, tokenizer = load(None)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=16)
    assert "Paris" in text
