"""Greedy decoding over a packed batch with the dense reference backend (tests, smoke runs, benchmarks)."""

from collections.abc import Iterable

import torch

from orbitflow.model.attention import DenseKVAttention
from orbitflow.model.llama import LlamaModel


@torch.inference_mode()
def greedy_generate(
    model: LlamaModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
) -> list[list[int]]:
    """Returns the generated ids of each prompt (stopping after an EOS id, which is included)."""
    eos = set(eos_token_ids)
    attention = DenseKVAttention(model.config.num_layers)
    outputs: list[list[int]] = [[] for _ in prompts]
    seq_lens = [len(p) for p in prompts]
    active = [i for i, p in enumerate(prompts) if p and max_new_tokens > 0]
    step_tokens = {i: prompts[i] for i in active}
    while active:
        input_ids = torch.tensor([t for i in active for t in step_tokens[i]], dtype=torch.long)
        positions = torch.tensor(
            [pos for i in active for pos in range(seq_lens[i] - len(step_tokens[i]), seq_lens[i])],
            dtype=torch.long,
        )
        attention.set_batch(active, [len(step_tokens[i]) for i in active])
        hidden = model(input_ids, positions, attention)
        last_rows = torch.tensor([len(step_tokens[i]) for i in active]).cumsum(0) - 1
        next_ids = model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()
        still_active = []
        for i, token in zip(active, next_ids):
            outputs[i].append(token)
            seq_lens[i] += 1
            step_tokens[i] = [token]
            if token in eos or len(outputs[i]) >= max_new_tokens:
                attention.free(i)
            else:
                still_active.append(i)
        active = still_active
    return outputs
