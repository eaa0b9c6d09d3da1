"""Decode throughput of orbitflow's LlamaModel (dense backend) vs transformers `generate`, SmolLM2-135M, CPU.

Run: PYTHONPATH=src .venv/bin/python tests/model/bench_decode_vs_hf.py   (not collected by pytest)
"""

import time

import torch
from transformers import LlamaForCausalLM

from orbitflow.model import greedy_generate, load_model

NEW_TOKENS = 64
PROMPTS = [
    "The history of the Roman empire",
    "Write a short poem about the sea and the wind that blows over it",
    "def fibonacci(n):",
    "Explain why the sky is blue in simple words, for a child of five years old.",
]


def hf_generate(hf, tokenizer, prompts: list[list[int]]) -> float:
    width = max(len(p) for p in prompts)
    pad = tokenizer.eos_token_ids[0]
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    hf.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=pad,
    )
    return time.perf_counter() - start


def ours_generate(model, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    greedy_generate(model, prompts, NEW_TOKENS)
    return time.perf_counter() - start


def main() -> None:
    loaded = load_model("smollm2-135m")
    hf = LlamaForCausalLM.from_pretrained(loaded.path, dtype=torch.float32, attn_implementation="sdpa").eval()
    encoded = [loaded.tokenizer.encode(p) for p in PROMPTS]
    for threads in sorted({1, torch.get_num_threads()}, reverse=True):
        torch.set_num_threads(threads)
        for batch in (1, 4):
            prompts = encoded[:batch]
            ours_generate(loaded.model, prompts)  # warm-up
            hf_generate(hf, loaded.tokenizer, prompts)
            ours = min(ours_generate(loaded.model, prompts) for _ in range(3))
            theirs = min(hf_generate(hf, loaded.tokenizer, prompts) for _ in range(3))
            tokens = batch * NEW_TOKENS
            print(
                f"threads {threads} batch {batch}: orbitflow {tokens / ours:7.1f} tok/s   "
                f"transformers {tokens / theirs:7.1f} tok/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
