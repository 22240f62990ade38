"""What several test modules share: the prompt set, greedy settings, tiny random models."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.sampling.params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "Rewrite with snake_case names:\ndef getValue(myInput):\n    myResult = myInput * 2\n"
    "    return myResult",
    "Correct the grammar: she go to school every days and play with her freinds.",
    "Continue the list: apples, bananas, cherries, dates,",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List the days of the week.",
    "Count from one to ten in words.",
    "Translate 'thank you very much' into French.",
    "What does HTTP stand for?",
    "Give three synonyms for happy.",
    "Write a Python function that returns the square of a number.",
    "Summarise: The cat sat on the mat. The cat was happy. The mat was red.",
    "Name the planets of the solar system in order.",
    "Say hello in five languages.",
    "What is 12 times 12?",
    "Describe a rainbow in two sentences.",
    "Fix the typo: teh weather is nice todya.",
    "Write the alphabet in capital letters.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
# A weather tool's parameters, bounded so that a small model's forced calls can finish.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def tiny_llama(path: Path, vocab: int, seed: int, hidden: int = 32, layers: int = 1) -> str:
    """A small random Llama saved as an HF checkpoint (a draft model, or a tiny target)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # peaky enough that drafts are sometimes right
    model.save_pretrained(path)
    return str(path)
