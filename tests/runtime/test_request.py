"""A request's own arithmetic: what the planner sees of it now and some steps on."""

from orbitflow.runtime.deposit import TokenDeposit
from orbitflow.runtime.request import Request
from orbitflow.runtime.sampling import SamplingParams


def _request(prompt: int, max_tokens: int, outputs: int = 0) -> Request:
    req = Request("r", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), 0.0, 0.05,
                  TokenDeposit(0.05))
    req.output_ids = list(range(outputs))
    return req


def test_plan_request_counts_its_tokens_blocks_and_what_is_left_some_steps_on():
    req = _request(prompt=30, max_tokens=8, outputs=2)  # 32 tokens, 6 left
    now = req.plan_request(block_size=16)
    assert (now.tokens, now.blocks_per_layer, now.tokens_left, now.deposit, now.slo_s) == (32, 2, 6, 0.0, 0.05)
    later = req.plan_request(block_size=16, ahead=1, deposit=0.2)  # the 33rd token opens a third block
    assert (later.tokens, later.blocks_per_layer, later.tokens_left, later.deposit) == (33, 3, 5, 0.2)
    past_the_end = req.plan_request(block_size=16, ahead=9)
    assert past_the_end.tokens_left == 0 and past_the_end.request_id == "r"
