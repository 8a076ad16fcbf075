"""The bench's requests: prompts of exact token length for a workload's lengths."""

from __future__ import annotations

from pathlib import Path

from splitserve.tokenizer import ByteTokenizer, load_tokenizer
from splitserve_tools.bench.main import BenchOptions, build_requests, rate_seed
from splitserve_tools.bench.prompts import exact_prompts, prompt_maker
from splitserve_tools.bench.requests import make_requests
from splitserve_tools.workload.lengths import workload_lengths


def test_requests_have_exact_byte_prompts() -> None:
    tok = ByteTokenizer()
    pairs = workload_lengths("code", 20, 512, seed=2)
    requests = make_requests(pairs, prompt_maker(tok), seed=2)
    assert [(r.input_len, r.output_len) for r in requests] == pairs
    assert all(len(tok.encode(r.prompt_text)) == r.input_len for r in requests)
    assert requests == make_requests(pairs, prompt_maker(tok), seed=2)


def test_exact_prompts_with_a_bpe_tokenizer(llama32_ckpt: Path) -> None:
    tok = load_tokenizer(llama32_ckpt)
    for length in (2, 17, 300):
        prompts = exact_prompts(tok, 3, length, seed=length)
        assert [len(tok.encode(p)) for p in prompts] == [length] * 3


def test_each_probed_rate_sends_prompts_of_its_own_with_the_same_lengths():
    opts = BenchOptions(targets=["llm"], num_requests=6, max_model_len=256)
    at_1, at_2 = build_requests(opts, 1.0), build_requests(opts, 2.0)
    assert [(r.input_len, r.output_len) for r in at_1] == [
        (r.input_len, r.output_len) for r in at_2
    ]
    assert not {r.prompt_text for r in at_1} & {r.prompt_text for r in at_2}
    assert build_requests(opts, 1.0) == at_1  # reproducible
    assert rate_seed(0, 1.0) != rate_seed(1, 1.0)
