"""Sampling: penalties, logit bias and logprobs as documented; one request's bad parameters never raise."""

import math
from dataclasses import replace

import torch

from orbitflow.runtime.sampling import SamplingParams, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])


def test_greedy_logprobs_are_the_models_own():
    drawn = sample(LOGITS, SamplingParams(logprobs=2))
    expected = torch.log_softmax(LOGITS, -1)
    assert drawn.token == 4 and drawn.error is None
    assert math.isclose(drawn.logprob, float(expected[4]), rel_tol=1e-6)
    assert [t for t, _ in drawn.top_logprobs] == [4, 0]
    assert math.isclose(drawn.top_logprobs[1][1], float(expected[0]), rel_tol=1e-6)


def test_logit_bias_and_penalties_change_the_greedy_choice():
    assert sample(LOGITS, SamplingParams(logit_bias=((1, 5.0),))).token == 1
    # Token 4 was generated twice: frequency 0.4 x 2 + presence 0.3 = 1.1 off its 3.0 leaves 1.9 < 2.0.
    assert sample(LOGITS, SamplingParams(frequency_penalty=0.4, presence_penalty=0.3), (), [4, 4]).token == 0
    assert sample(LOGITS, SamplingParams(frequency_penalty=0.4), (), [4, 4]).token == 4  # 2.2 > 2.0
    # Repetition penalty 2 halves the positive logits of tokens in the prompt or output: 4 -> 1.5 < 2.0.
    assert sample(LOGITS, SamplingParams(repetition_penalty=2.0), [4], ()).token == 0
    assert sample(LOGITS, SamplingParams(repetition_penalty=2.0), [1], ()).token == 4


def test_extreme_parameters_neither_raise_nor_fail():
    # The inputs of issue 13's D1: each used to raise inside the engine step.
    for params in (SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=5e-324),
                   SamplingParams(temperature=1.0, seed=10**30), SamplingParams(temperature=1.0, seed=-(2**63))):
        drawn = sample(LOGITS, params)
        assert drawn.error is None and 0 <= drawn.token < len(LOGITS)
    assert sample(LOGITS, SamplingParams(temperature=1e-300)).token == 4  # a vanishing temperature is greedy
    assert sample(LOGITS, SamplingParams(temperature=1.0, top_p=5e-324)).token == 4  # the top token stays


def test_logits_pushed_past_the_float_range_sample_among_those_tokens():
    """A repetition_penalty near 0 divides the seen tokens' positive logits past float32's range (then inf), and a
    small temperature can do the same to a large finite one: the limit of the softmax, uniform over those tokens,
    not a 'degenerate distribution' error (the API allows any penalty in (0, 2])."""
    seen = [0, 1]  # positive logits 2.0 and 1.0; token 4 (3.0) is not seen
    for params, tokens in ((SamplingParams(temperature=1.0, repetition_penalty=1e-300), {0, 1}),
                           # 2e38 and 1e38 are finite; / 0.5, only token 0's overflows
                           (SamplingParams(temperature=0.5, repetition_penalty=1e-38), {0})):
        drawn = [sample(LOGITS, replace(params, seed=s), seen, ()) for s in range(40)]
        assert all(d.error is None for d in drawn)
        assert {d.token for d in drawn} == tokens
    # greedy: the first of the saturated tokens (argmax of equal infinities)
    assert sample(LOGITS, SamplingParams(repetition_penalty=1e-300), seen, ()).token == 0


def test_a_failure_comes_back_as_an_error_not_an_exception():
    drawn = sample(LOGITS, SamplingParams(logit_bias=((10**6, 1.0),)))  # outside the vocabulary
    assert drawn.token is None and "IndexError" in drawn.error
    nan = sample(torch.full((5,), float("nan")), SamplingParams(temperature=1.0))
    assert nan.token is None and "degenerate" in nan.error
    bad_logprobs = sample(LOGITS, SamplingParams(logprobs=2.5))  # the Python API checks no type; the batch goes on
    assert bad_logprobs.token is None and "topk" in bad_logprobs.error


def test_seeded_sampling_is_reproducible():
    """The same seed draws the same tokens; each step draws afresh (a seed that ignored the step drew one token 20
    times and passed the comparison alone), and another seed draws another sequence."""
    params = SamplingParams(temperature=1.0, seed=7)
    tokens = [sample(LOGITS, params, (), [0] * i).token for i in range(20)]
    assert tokens == [sample(LOGITS, params, (), [0] * i).token for i in range(20)]
    assert len(set(tokens)) > 1
    other = SamplingParams(temperature=1.0, seed=8)
    assert [sample(LOGITS, other, (), [0] * i).token for i in range(20)] != tokens


def test_the_position_may_come_without_the_history():
    """A tensor-parallel step sends rank 0 no token histories unless a penalty reads them: the seeded draw then takes
    its position from ``generated`` and must be the draw the whole history gives."""
    params = SamplingParams(temperature=1.0, seed=7)
    assert not params.reads_history
    full = [sample(LOGITS, params, (), [0] * i).token for i in range(20)]
    assert [sample(LOGITS, params, (), (), generated=i).token for i in range(20)] == full
    for penalty in ({"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}):
        assert SamplingParams(**penalty).reads_history
