"""End to end on the real default model: `orbitflow generate` is token-identical to transformers."""

import json

import pytest
import torch

from orbitflow.cli import main
from orbitflow.config import EngineConfig
from orbitflow.llm import LLM
from orbitflow.policies import FixedPlacementPolicy
from orbitflow.runtime.sampling import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "Once upon a time, in a small village nestled between two mountains, there lived an old clockmaker "
    "who had never once left the valley. Every morning he",
    "def fibonacci(n):",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def loaded():
    from orbitflow.model.loader import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def transformers_greedy(loaded):
    """prompts -> transformers' greedy tokens for each, one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(loaded.path, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(loaded.path)

    def greedy(prompts):
        outs = []
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                  do_sample=False)
            outs.append(out[0, ids.shape[1]:].tolist())
        return outs

    greedy.tokenizer = tok
    return greedy


@pytest.fixture(scope="module")
def reference(transformers_greedy):
    return transformers_greedy(PROMPTS)


def generate(loaded, spec, prompts=PROMPTS, **config):
    config.setdefault("device_kv_blocks", 4096)
    llm = LLM(EngineConfig.build(max_num_seqs=len(prompts), **config), policy=FixedPlacementPolicy(spec),
              profile="rough", loaded=loaded)
    try:
        reqs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        assert llm.kv.usage() == (0, 0)
        return [r.output_ids for r in reqs], llm.stats()
    finally:
        llm.close()


@pytest.mark.parametrize("spec", ["none", "all", "distance:3", "random:5"])
def test_every_placement_matches_transformers(loaded, reference, spec):
    outputs, _ = generate(loaded, spec)
    assert outputs == reference


@pytest.mark.parametrize("spec", ["none", "distance:3"])
def test_split_k_decode_matches_transformers(loaded, reference, spec, monkeypatch):
    """Decode attention cut into stretches merged by logsumexp (split-K: what rows of 2048 tokens or more get on a
    CPU with 2 threads) gives transformers' tokens; forced here on short prompts. A decode step with copies
    beside it (host layers) is not split (`ModelExecutor._decode_layer`)."""
    from orbitflow.model import attention
    from orbitflow.runtime.executor import ModelExecutor

    real_flash, real_splits, real_decode, real_layer = (attention._CPU_FLASH, attention.decode_splits,
                                                        attention.decode_attention, ModelExecutor._decode_layer)
    calls, inside = [], []  # per decode layer: [the step has copies, split_k, the largest batch of stretches]

    def decode_layer(self, st, *args):
        calls.append([any(st.fetches.values()), None, 1])
        return real_layer(self, st, *args)

    def decode(q, kv, scale, split_k=True):
        calls[-1][1] = split_k
        inside.append(calls[-1])
        try:
            return real_decode(q, kv, scale, split_k)
        finally:
            inside.pop()

    def flash(query, *args, **kwargs):
        if inside and query.stride(0) == 0:  # stretches of one row (its query expanded), not a group of rows
            inside[-1][2] = max(inside[-1][2], query.shape[0])
        return real_flash(query, *args, **kwargs)

    monkeypatch.setattr(attention, "SPLIT_MIN_TOKENS", 2)
    monkeypatch.setattr(attention, "decode_splits", lambda heads, context, threads: real_splits(heads, context,
                                                                                                 min(threads, 2)))
    monkeypatch.setattr(attention, "_CPU_FLASH", flash)
    monkeypatch.setattr(attention, "decode_attention", decode)
    monkeypatch.setattr(ModelExecutor, "_decode_layer", decode_layer)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))  # split-K needs threads to share among
    try:
        outputs, _ = generate(loaded, spec)
    finally:
        torch.set_num_threads(threads)
    assert outputs == reference
    assert all(split_k is (not copies) and (stretches == 2) is split_k for copies, split_k, stretches in calls)
    if spec == "none":
        assert any(split_k for _, split_k, _ in calls), "no decode step was split: the test would prove nothing"
    else:
        assert any(copies for copies, _, _ in calls), "no decode step had copies: the test would prove nothing"


@pytest.mark.parametrize("spec", ["none", "distance:3"])
def test_grouped_decode_rows_match_transformers(loaded, transformers_greedy, spec, monkeypatch):
    """Rows of one length whose KV runs one SDPA call takes together (`row_groups`) give transformers' tokens, with
    every layer on the device and with host layers (read from staged copies) between: different prompts of the
    same length (a call that read one row's KV for another would change their tokens)."""
    from orbitflow.model import attention

    real_group, grouped = attention._group_decode, []

    def group_decode(q, kv, rows, scale):
        grouped.append(len(rows))
        return real_group(q, kv, rows, scale)

    monkeypatch.setattr(attention, "_group_decode", group_decode)
    prompts = ["The capital of France is", "The capital of Japan is", "Write a short poem:", "Once upon a time there"]
    lengths = {len(transformers_greedy.tokenizer(p).input_ids) for p in prompts}
    assert len(lengths) == 1, f"the prompts must share a length: {lengths}"
    expected = transformers_greedy(prompts)
    assert len({tuple(e) for e in expected}) == len(prompts), "rows that generate alike would hide a mix-up"
    outputs, _ = generate(loaded, spec, prompts)
    assert outputs == expected
    assert grouped, "no rows were grouped: the test would prove nothing"


def test_batched_equals_alone(loaded, reference):
    alone = [generate(loaded, "distance:2", [p])[0][0] for p in PROMPTS[:2]]
    assert alone == reference[:2]


def test_cli_json_output(reference, capsys):
    argv = ["generate", "--json", "--max-tokens", str(MAX_TOKENS), "--placement", "distance:4",
            "--device-kv-blocks", "4096"]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert [o["token_ids"] for o in result["outputs"]] == reference
    assert [o["prompt"] for o in result["outputs"]] == PROMPTS
    stats = result["stats"]
    assert stats["host_blocks_peak"] > 0 and stats["bytes_h2d"] > 0
    assert len(stats["step_s"]) >= MAX_TOKENS


def test_cli_errors_are_one_line(capsys):
    assert main(["generate", "--prompt", "x", "--policy", "warp-drive"]) == 2  # before the model loads
    assert "--policy" in capsys.readouterr().err
    for argv, says in ((["--prompt", ""], "at least one token"),
                       (["--prompt", "x", "--max-tokens", "9000"], "context length")):
        assert main(["generate", "--placement", "none", *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert main(["generate", "--prompt", "x", "--model", "/nonexistent/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/model.gguf" in err and "Traceback" not in err
    assert main(["generate", "--prompt", "x", "--placement", "distance:0"]) == 2
    assert "--placement" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--placement", "distance:31"]) == 2  # once silently "none"
    err = capsys.readouterr().err
    assert "--placement distance:31 offloads no layer of the model's 30" in err and "Traceback" not in err, err
    assert "max_tokens" not in err and "prompt" not in err  # the flag's mistake, found before measuring


def test_slow_link_stalls_grow_with_offloaded_layers(loaded):
    stall = {spec: generate(loaded, spec, PROMPTS[:2], link_gbps=0.05)[1].stall_s
             for spec in ("none", "distance:4", "all")}
    assert stall["none"] == 0.0
    assert 0 < stall["distance:4"] < stall["all"]


def _profile_file(tmp_path, num_layers, kv_bytes=1536):  # SmolLM2-135M: 3 KV heads x 64 x K and V x float32
    from orbitflow.plan.hardware import HardwareProfile

    path = tmp_path / f"profile-{num_layers}-{kv_bytes}.json"
    path.write_text(HardwareProfile(name="saved", num_layers=num_layers, kv_bytes_per_token_per_layer=kv_bytes,
                                    decode_a=1e-7, decode_b=0.03, link_bytes_per_s=1e10, device_kv_blocks=4096,
                                    host_kv_blocks=4096, block_size=16).to_json())
    return str(path)


def test_generate_with_a_saved_profile_measures_nothing(reference, capsys, tmp_path, monkeypatch):
    """`orbitflow profile --out FILE` once, then `--profile FILE`: generate starts without its minutes of measuring
    (the plans come from the file), with the same greedy tokens."""
    import orbitflow.runtime.profiler

    def measured(*args, **kwargs):
        raise AssertionError("measured the machine despite --profile")

    monkeypatch.setattr(orbitflow.runtime.profiler, "profile_executor", measured)
    argv = ["generate", "--json", "--max-tokens", str(MAX_TOKENS), "--prompt", PROMPTS[0],
            "--profile", _profile_file(tmp_path, 30)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["outputs"][0]["token_ids"] == reference[0]


@pytest.mark.parametrize("layers, kv_bytes, says", [
    (4, 1536, "hardware profile 'saved' is of 4 layers and 16-token blocks, this engine runs 30 layers"),
    (30, 768, "hardware profile 'saved' moves 768 KV bytes per token and layer, this engine 1536"),
    (None, None, "--profile /nonexistent/p.json: No such file or directory"),
])
def test_generate_refuses_a_profile_of_another_model_or_none(capsys, tmp_path, layers, kv_bytes, says):
    path = "/nonexistent/p.json" if layers is None else _profile_file(tmp_path, layers, kv_bytes)
    assert main(["generate", "--prompt", "x", "--max-tokens", "2", "--profile", path]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_generate_refuses_a_profile_measured_under_another_link_throttle(capsys, tmp_path):
    path = _profile_file(tmp_path, 30)  # planned for a 10 GB/s link
    assert main(["generate", "--prompt", "x", "--max-tokens", "2", "--profile", path, "--link-gbps", "1"]) == 2
    err = capsys.readouterr().err
    assert "plans for a link of 10 GB/s, this engine's is throttled to 1 GB/s (--link-gbps)" in err, err
    assert "Traceback" not in err
