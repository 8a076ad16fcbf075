from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from splitserve.tokenizer import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    BYTE_PAD_ID,
    BYTE_VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
)

SPECIALS_TEXT = "<s> looks special </s> <|begin_of_text|> <|eot_id|>"
TEXTS = [
    "",
    "Hello world",
    " leading and trailing spaces  ",
    "The old lighthouse keeper climbed the spiral stairs.",
    "café naïve résumé 東京 😀 Москва",
    "emoji 🤖🦾👩‍👩‍👧 flags 🇯🇵 and ZWJ",
    "tabs\tand\nnew\n\nlines\r\n",
    SPECIALS_TEXT,
    "numbers 1234567 3.14159 -42",
    "def f(x):\n    return x ** 2  # comment",
    "\ufffd replacement char stays",
]
TOKENIZER_CKPTS = ["llama32_ckpt", "mistral_ckpt"]


@pytest.fixture(params=TOKENIZER_CKPTS)
def ckpt(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_encode_matches_transformers(ckpt: Path) -> None:
    ours = HFTokenizer(ckpt)
    ref = AutoTokenizer.from_pretrained(ckpt)
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.encode(text)[0] == ours.bos_token_id == ref.bos_token_id


def test_decode_round_trip_matches_transformers(ckpt: Path) -> None:
    ours = HFTokenizer(ckpt)
    ref = AutoTokenizer.from_pretrained(ckpt)
    for text in TEXTS:
        ids = ours.encode(text)
        if text != SPECIALS_TEXT:
            assert ours.decode(ids) == text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_special_ids(llama32_ckpt: Path, mistral_ckpt: Path) -> None:
    llama3 = HFTokenizer(llama32_ckpt)
    vocab = json.loads((llama32_ckpt / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert llama3.bos_token_id == ids["<|begin_of_text|>"]
    assert llama3.eos_token_ids == (ids["<|end_of_text|>"], ids["<|eot_id|>"])
    assert llama3.pad_token_id is None
    assert llama3.vocab_size == 1024
    llama2 = HFTokenizer(mistral_ckpt)
    assert (llama2.bos_token_id, llama2.eos_token_ids) == (1, (2,))


def _with_tokenizer_config(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update(changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_explicit_add_bos_and_eos_override_post_processor(
    mistral_ckpt: Path, tmp_path: Path
) -> None:
    plain = HFTokenizer(mistral_ckpt).encode("hello")[1:]
    no_bos = HFTokenizer(_with_tokenizer_config(mistral_ckpt, tmp_path / "a", add_bos_token=False))
    assert no_bos.encode("hello") == plain
    both = HFTokenizer(_with_tokenizer_config(mistral_ckpt, tmp_path / "b", add_eos_token=True))
    assert both.encode("hello") == [1, *plain, 2]


def test_added_token_dict_and_pad(mistral_ckpt: Path, tmp_path: Path) -> None:
    tok = HFTokenizer(
        _with_tokenizer_config(
            mistral_ckpt,
            tmp_path / "c",
            bos_token={"content": "<s>", "lstrip": False, "special": True},
            pad_token={"content": "<unk>"},
        )
    )
    assert (tok.bos_token_id, tok.pad_token_id) == (1, 0)


def test_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    assert (BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE) == (256, 257, 258, 259)
    assert tok.encode("aé") == [256, 97, 0xC3, 0xA9]
    assert tok.vocab_size == 259 and tok.eos_token_ids == (257,) and tok.pad_token_id == 258
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([256, 104, 105, 257, 258]) == "hi"
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=False) == "<s>hi</s>"
    assert tok.decode([104, 300, 105, -1]) == "hi"
    assert tok.decode([0xE6, 0x97]) == "\ufffd"


def test_load_tokenizer(mistral_ckpt: Path, llama_bytes_ckpt: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(llama_bytes_ckpt), ByteTokenizer)
    assert isinstance(load_tokenizer(str(mistral_ckpt)), HFTokenizer)


def _stream(tok: Tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in output]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def _tokenizers(ckpt: Path) -> list[Tokenizer]:
    return [HFTokenizer(ckpt), ByteTokenizer()]


def test_detokenizer_valid_text_never_emits_replacement(ckpt: Path) -> None:
    rng = random.Random(0)
    pieces = [w for t in TEXTS for w in t.split(" ") if "\ufffd" not in w]
    for tok in _tokenizers(ckpt):
        for _ in range(30):
            prompt = tok.encode(" ".join(rng.choices(pieces, k=3)))
            output = tok.encode(" ".join(rng.choices(pieces, k=8)))[1:]
            deltas = _stream(tok, prompt, output)
            assert "".join(deltas) == tok.decode(output)
            assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_split_characters() -> None:
    deltas = _stream(ByteTokenizer(), [BYTE_BOS_ID], list("a😀b".encode()))
    assert deltas == ["a", "", "", "", "😀", "b", ""]


def test_detokenizer_random_ids_match_full_decode(ckpt: Path) -> None:
    rng = random.Random(1)
    for tok in _tokenizers(ckpt):
        for _ in range(100):
            prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(8))]
            output = [rng.randrange(tok.vocab_size + 8) for _ in range(rng.randrange(1, 40))]
            assert "".join(_stream(tok, prompt, output)) == tok.decode(output)


def test_detokenizer_flush_emits_incomplete_tail() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), [BYTE_BOS_ID])
    assert detok.add(ord("x")) == "x"
    assert detok.add(0xF0) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""
    assert detok.text == "x\ufffd"


def test_detokenizer_prompt_ending_mid_character() -> None:
    tok = ByteTokenizer()
    emoji = list("😀".encode())
    deltas = _stream(tok, [BYTE_BOS_ID, *emoji[:2]], [*emoji[2:], ord("!")])
    assert "".join(deltas) == tok.decode([*emoji[2:], ord("!")])


def test_detokenizer_keeps_special_tokens_when_asked(mistral_ckpt: Path) -> None:
    tok = HFTokenizer(mistral_ckpt)
    output = [*tok.encode("hi")[1:], 2]
    detok = IncrementalDetokenizer(tok, tok.encode("x"), skip_special_tokens=False)
    text = "".join(detok.add(i) for i in output) + detok.flush()
    assert text == "hi</s>"
