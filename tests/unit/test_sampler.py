"""Sampling transforms against Hugging Face's logits processors and plain definitions."""

import torch
from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from splitserve.engine.request import Request
from splitserve.engine.sampler import apply_penalties, filter_logits, sample, token_generator
from splitserve.engine.sampling_params import SamplingParams


def _req(**kw) -> Request:
    req = Request("r", [3, 5, 5, 9], SamplingParams(**kw))
    req.output_ids = [5, 7, 7, 7]
    return req


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(16, generator=torch.Generator().manual_seed(0))
    req = _req(repetition_penalty=1.3)
    ours = apply_penalties(logits.clone(), req)
    ids = torch.tensor([req.all_ids])
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone()[None])[0]
    torch.testing.assert_close(ours, theirs)


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(10)
    out = apply_penalties(logits, _req(presence_penalty=0.5, frequency_penalty=0.25))
    expected = torch.zeros(10)
    expected[5] -= 0.5 + 0.25 * 1
    expected[7] -= 0.5 + 0.25 * 3
    torch.testing.assert_close(out, expected)


def test_top_k_and_top_p_match_transformers():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 3
    for k in (1, 5, 20):
        theirs = TopKLogitsWarper(k)(None, logits[None].clone())[0]
        assert torch.equal(filter_logits(logits, k, 1.0, 0.0).isinf(), theirs.isinf())
    for p in (0.1, 0.5, 0.9):
        theirs = TopPLogitsWarper(p)(None, logits[None].clone())[0]
        assert torch.equal(filter_logits(logits, -1, p, 0.0).isinf(), theirs.isinf())


def test_seeded_token_depends_only_on_seed_and_index():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    a, b = _req(temperature=1.0, seed=11), _req(temperature=1.0, seed=11)
    assert sample(logits[:1], [a], [[]]) == sample(logits[:1], [b], [[]])
    g1, g2 = token_generator(11, 4), token_generator(11, 5)
    assert torch.rand(4, generator=g1).tolist() != torch.rand(4, generator=g2).tolist()


def test_suppressed_tokens_are_never_sampled():
    logits = torch.zeros(1, 4)
    logits[0, 2] = 100.0
    assert sample(logits, [_req(temperature=0.0)], [[2]]) != [2]
