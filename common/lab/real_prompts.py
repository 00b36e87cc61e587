"""Prompts for a real model (``smollm2-135m``): chat questions and long documents of a set length.

The exactness tests and ``scripts/bench_vs_vllm.py`` share them, so both measure the same text. The
long documents are plain English sentences drawn (seeded) from fixed word lists: a real tokenizer cuts
them like ordinary prose, and the same seed gives the same tokens in every process.
"""

from __future__ import annotations

import random
from typing import Any

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 plus 30?",
    "Write one sentence about the sea.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "How many days are in a week?",
    "Translate 'good morning' into French.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet cat.",
    "What is the largest planet in the solar system?",
    "List two fruits that are yellow.",
    "What language is spoken in Brazil?",
    "Explain what a noun is in one sentence.",
    "Who wrote Romeo and Juliet?",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
    "Give a tip for sleeping well.",
    "What is the chemical symbol for gold?",
    "Describe a rainy day in five words.",
    "What gas do plants take in?",
)

STORY_REQUEST = "Write a short story about a robot who learns to paint."  # a long answer (decode failover)

_SUBJECTS = ("The river", "A small village", "The old library", "Every morning the baker", "The mountain road",
             "A quiet student", "The harbor", "Our neighbor", "The north wind", "A tired traveler")
_VERBS = ("carried", "remembered", "painted", "followed", "gathered", "watched", "built", "answered", "crossed", "kept")
_OBJECTS = ("the evening light", "a basket of apples", "the long winter", "three letters", "the market square",
            "a forgotten song", "the wooden bridge", "the first snow", "a map of the coast", "the empty station")
_ENDS = ("before the rain came.", "while the town slept.", "with great care.", "for many years.", "as the bells rang.",
         "without a word.", "near the edge of the forest.", "under a pale sky.", "after the long harvest.", "once again.")


def chat_messages(question: str) -> list[dict[str, str]]:
    """One user turn."""
    return [{"role": "user", "content": question}]


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    """Token ids of ``question`` as one user turn in the tokenizer's chat template, with the
    generation prompt: what the gateway's ``/v1/chat/completions`` builds from the same message."""
    text = tokenizer.apply_chat_template(chat_messages(question), add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def document(n_tokens: int, tokenizer: Any, seed: int = 0) -> str:
    """Seeded English sentences whose encoding is at least ``n_tokens`` tokens (within one sentence)."""
    rng = random.Random(seed)
    parts: list[str] = []
    count = 0
    while count < n_tokens:
        batch = [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDS)}"
                 for _ in range(max(1, (n_tokens - count) // 12))]
        parts += batch
        count = len(tokenizer.encode(" ".join(parts), add_special_tokens=False))
    return " ".join(parts)


def document_ids(n_tokens: int, tokenizer: Any, seed: int = 0) -> list[int]:
    """Exactly ``n_tokens`` token ids: the start of :func:`document`'s encoding."""
    return list(tokenizer.encode(document(n_tokens, tokenizer, seed), add_special_tokens=False))[:n_tokens]
