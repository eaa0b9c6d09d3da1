"""Write a seeded random-weight Llama checkpoint (HF directory) shaped like a given model, with its tokenizer.

For machines that cannot receive the real weights (the 98 MB SmolLM2 GGUF does not fit through some links) but
must still run the engine end to end: token identity against transformers and timings depend on the architecture,
not on the weights' values. The same seed gives the same weights.

Run: ``python benchmarks/random_model.py --like DIR --out DIR [--layers N --hidden H ...] [--seed 0]``
(``--like`` is an HF directory with config.json and tokenizer.json, e.g. the converted SmolLM2 in
``~/.cache/orbitflow/models``; the shape flags override its config.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

SHAPE_FLAGS = {  # flag -> config.json key
    "layers": "num_hidden_layers", "hidden": "hidden_size", "intermediate": "intermediate_size",
    "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--like", required=True, type=Path, help="HF directory whose config and tokenizer are copied")
    p.add_argument("--out", required=True, type=Path, help="directory to write (created; must not hold a model)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default %(default)s)")
    for flag, key in SHAPE_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, help=f"override {key}")
    p.add_argument("--init-std", type=float, default=0.1,
                   help="standard deviation of the weights (default %(default)s; the 0.02 of training recipes gives "
                        "near-flat logits, so greedy decoding repeats one token and tests little)")
    p.add_argument("--device", default="cpu", help="where the weights are initialised (default %(default)s)")
    args = p.parse_args(argv)
    if not (args.like / "config.json").is_file():
        p.error(f"--like {args.like}: no config.json there")
    if (args.out / "config.json").exists():
        p.error(f"--out {args.out}: already holds a model")
    for flag in SHAPE_FLAGS:
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((args.like / "config.json").read_text())
    for flag, key in SHAPE_FLAGS.items():
        if getattr(args, flag) is not None:
            config[key] = getattr(args, flag)
    config["architectures"] = ["LlamaForCausalLM"]
    config["initializer_range"] = args.init_std
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**config))
    args.out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.like / name).exists():
            shutil.copy(args.like / name, args.out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"random_model: wrote {args.out} ({params / 1e6:.0f}M parameters, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
