"""Random-weight Hugging Face checkpoints (config, safetensors, tokenizer) for tests and demos.

The weights are scaled so that greedy decoding wanders over many tokens and the top logit leads the
runner-up by a clear margin: an fp32 engine must then reproduce a reference token for token.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, TypedDict

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizerBackend
from tqdm import tqdm

from splitserve.kv.layout import DTYPES
from splitserve.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE

Arch = Literal["llama", "qwen2", "mistral"]
TokenizerStyle = Literal["bpe", "llama3"]

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
LLAMA2_SPECIALS = ("<unk>", "<s>", "</s>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PROGRESS_MIN_PARAMS = 20_000_000
PADDING_LOGIT_SCALE = 0.1


class Preset(TypedDict):
    """Sizes that ``write_random_checkpoint`` takes as keywords."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=688,
        vocab_size=2048,
    ),
    "100m": Preset(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
    ),
}

CORPUS = """\
The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick,
polished the brass, and watched the ships drift past the rocky headland. Nobody remembered when he
had first arrived, but everyone in the village agreed that the light had never once failed.
In the spring the orchards bloom white and pink, and bees hum between the rows of apple trees.
Farmers check the weather twice a day, because a late frost can ruin a whole season of fruit.
Machine learning models are trained on large datasets; they learn statistical patterns that let
them predict the next word, classify images, or translate between languages. Training requires
careful tuning of the learning rate, the batch size, and the number of optimization steps.
A server receives thousands of requests per second. Each request carries a prompt, and the server
must schedule the work so that latency stays low while throughput remains high. Caching, batching
and streaming responses are common techniques; so are admission control and graceful shutdown.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for (int i = 0; i < 10; ++i) { total += values[i] * weights[i]; }
SELECT name, count(*) FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY 2 DESC;
{"id": 42, "name": "widget", "price": 19.99, "tags": ["blue", "small"], "in_stock": true}
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
On Tuesday, March 14th, 2023, the temperature reached 27 degrees Celsius at 3:45 pm.
The recipe calls for 250 grams of flour, 2 eggs, 100 ml of milk, and a pinch of salt.
Mathematics studies numbers, shapes, structures and change. Physics describes motion, energy,
forces and fields; chemistry explains reactions between atoms and molecules; biology explores
cells, genes, evolution and the astonishing variety of living organisms on our planet.
She opened the letter slowly. "I can't believe it," she whispered. "They've accepted us!"
Rivers carve valleys over millions of years, and glaciers grind mountains into gravel and sand.
Historians argue about causes; economists argue about incentives; poets simply argue about love.
The committee will meet again next week to review the budget, discuss the proposal, and vote.
Children played football in the park while their parents chatted on wooden benches nearby.
Please remember to save your work frequently, back up important files, and update passwords.
Jazz musicians improvise melodies over chord progressions, trading solos late into the night.
The museum's new exhibition features ancient pottery, bronze tools, and illuminated manuscripts.
Astronomers discovered a distant galaxy whose light left it more than twelve billion years ago.
Volcanic islands rise from the ocean floor, cool into black basalt, and slowly grow green forests.
Engineers inspect bridges for corrosion, fatigue cracks, loose bolts, and worn expansion joints.
A good teacher asks questions, listens patiently, and encourages curiosity rather than memorizing.
The marathon runners crossed the finish line exhausted, cheering, limping, hugging strangers.
Compilers translate source code into machine instructions, optimizing loops and inlining calls.
Databases guarantee atomicity, consistency, isolation and durability through logs and locks.
Photographers wait for golden light; painters mix pigments; sculptors chisel marble and granite.
Migratory birds navigate thousands of kilometres using the sun, the stars, and magnetic fields.
Hospitals rely on nurses, surgeons, pharmacists, technicians, cleaners, and volunteers alike.
Our neighbour grows tomatoes, cucumbers, peppers, pumpkins, lettuce and fragrant basil leaves.
Thunderstorms gathered above the prairie; lightning flickered and heavy raindrops drummed loudly.
Submarines explore trenches where sunlight never reaches and strange luminous creatures glow.
Archaeologists carefully brushed dust from fragile bones, coins, beads, and broken ceramics.
Philosophers wonder whether knowledge, justice, beauty, and freedom can ever be fully defined.
Keyboard shortcuts: Ctrl+C copies, Ctrl+V pastes, Ctrl+Z undoes, and Alt+Tab switches windows.
Quantum computers manipulate qubits through superposition, entanglement, and interference.
Volunteers organized a charity auction, raising twelve thousand dollars for the local shelter.
Un café au lait, s'il vous plaît. Le garçon était très naïf, mais très gentil avec tout le monde.
Der Bäcker öffnet um sechs Uhr morgens; die Brötchen sind frisch und duften wunderbar.
El niño comió una manzana y después jugó con su perro en el jardín de la abuela.
Москва — столица России. Привет, как дела? Ελληνικά γράμματα: αλφα, βήτα, γάμμα, δέλτα.
東京は日本の首都です。今日は良い天気ですね。北京是中国的首都。我喜欢学习新的语言。
서울은 한국의 수도입니다. 안녕하세요! मुझे हिंदी पढ़ना पसंद है। שלום עולם. مرحبا بالعالم.
Emoji also appear in text: 😀 🚀 🎉 👍 ❤️ 🌍 🐍 ☕ — café naïve résumé façade coöperate jalapeño.
Symbols: © ® ™ € £ ¥ § ¶ † ‡ • … ‰ ′ ″ ← → ↑ ↓ ∀ ∃ ∅ ∞ ≈ ≠ ≤ ≥ ∑ ∏ √ ∫ α β γ δ ε π σ ω.
"""


def write_random_checkpoint(
    out_dir: str | Path,
    *,
    arch: Arch = "llama",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 344,
    vocab_size: int = 1024,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    config_layout: Literal["legacy", "rope_parameters"] = "legacy",
    max_position_embeddings: int = 2048,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    num_shards: int = 1,
    seed: int = 0,
    weight_scale: float = 1.0,
    tokenizer: TokenizerStyle | None = "bpe",
    sliding_window: int | None = None,
) -> Path:
    """Write the checkpoint into ``out_dir`` (created if needed) and return its path.

    ``weight_scale`` multiplies the standard deviation of every weight matrix;
    ``sliding_window`` applies to every layer (mistral, qwen2). Config rows past the tokenizer's
    size get small output embeddings, so greedy decoding prefers tokens the tokenizer can spell.
    Without a tokenizer the ids are ``ByteTokenizer``'s (BOS 256, EOS 257), which
    ``load_tokenizer`` then falls back to.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")
    head_dim = head_dim or hidden_size // num_heads
    if arch == "qwen2" and head_dim != hidden_size // num_heads:
        raise ValueError("qwen2 derives head_dim from hidden_size // num_heads")
    if arch == "llama" and sliding_window is not None:
        raise ValueError("llama has no sliding window")
    if not 1 <= num_shards <= num_layers + 2:
        raise ValueError(f"num_shards must be in [1, {num_layers + 2}]")
    if tokenizer is None and vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(f"without a tokenizer vocab_size must be at least {BYTE_VOCAB_SIZE}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors*"), *out.glob("tokenizer*.json")]:
        stale.unlink()

    bos_id, eos_ids, real_vocab = BYTE_BOS_ID, [BYTE_EOS_ID], min(vocab_size, BYTE_VOCAB_SIZE)
    if tokenizer is not None:
        bos_id, eos_ids, real_vocab = write_tokenizer(out, tokenizer, vocab_size)
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6 if arch == "qwen2" else 1e-5,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": _one_or_list(eos_ids),
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "attention_bias": arch == "qwen2",
        **_arch_fields(arch, head_dim, num_layers, sliding_window),
        **_rope_fields(config_layout, rope_theta, rope_scaling, dtype),
    }
    _write_json(out / "config.json", config)
    generation = {"bos_token_id": bos_id, "eos_token_id": _one_or_list(eos_ids)}
    _write_json(out / "generation_config.json", generation)
    _write_weights(out, config, real_vocab, num_shards, seed, weight_scale, DTYPES[dtype])
    return out


def _arch_fields(arch: str, head_dim: int, num_layers: int, window: int | None) -> dict:
    if arch == "llama":
        return {"head_dim": head_dim, "mlp_bias": False, "pretraining_tp": 1}
    if arch == "mistral":
        return {"head_dim": head_dim, "sliding_window": window}
    return {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window is not None else num_layers,
    }


def _rope_fields(layout: str, theta: float, rope_scaling: dict | None, dtype: str) -> dict:
    """Before transformers 5: ``rope_theta`` + ``rope_scaling``; since: ``rope_parameters``."""
    if layout == "legacy":
        return {
            "torch_dtype": dtype,
            "rope_theta": theta,
            "rope_scaling": _legacy_rope_scaling(rope_scaling),
        }
    if layout == "rope_parameters":
        scaling = dict(rope_scaling or {"rope_type": "default"})
        params = {"rope_type": scaling.pop("rope_type"), "rope_theta": theta, **scaling}
        return {"dtype": dtype, "rope_parameters": params}
    raise ValueError(f"config_layout must be 'legacy' or 'rope_parameters', got {layout!r}")


def _legacy_rope_scaling(rope_scaling: dict | None) -> dict | None:
    if rope_scaling is None:
        return None
    scaling = dict(rope_scaling)
    if scaling["rope_type"] == "linear":
        scaling["type"] = "linear"
    return scaling


def _one_or_list(ids: list[int]) -> int | list[int]:
    return ids[0] if len(ids) == 1 else list(ids)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _weight_specs(config: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init kind) of every tensor, in a fixed order."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config.get("head_dim", h // config["num_attention_heads"])
    kv = q // config["num_attention_heads"] * config["num_key_value_heads"]
    yield "model.embed_tokens.weight", (vocab, h), "embed"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), "norm"
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            yield p + f"self_attn.{name}_proj.weight", (rows, h), name
            if config["attention_bias"]:
                yield p + f"self_attn.{name}_proj.bias", (rows,), "bias"
        yield p + "self_attn.o_proj.weight", (h, q), "o"
        yield p + "post_attention_layernorm.weight", (h,), "norm"
        yield p + "mlp.gate_proj.weight", (inter, h), "gate"
        yield p + "mlp.up_proj.weight", (inter, h), "up"
        yield p + "mlp.down_proj.weight", (h, inter), "down"
    yield "model.norm.weight", (h,), "norm"
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", (vocab, h), "lm_head"


# Standard deviation of each kind, times 1/sqrt(fan_in) for matrices. The residual stream grows well
# past the token embedding, so (tied) output embeddings do not just echo the input token, and query
# and key are sharp enough for attention to make each step depend on the context.
INIT_GAIN: dict[str, float] = {
    "embed": 6.0,
    "q": 2.0,
    "k": 2.0,
    "v": 1.0,
    "o": 4.0,
    "gate": 1.0,
    "up": 1.0,
    "down": 4.0,
    "lm_head": 6.0,
}


def _init_tensor(
    kind: str, shape: tuple[int, ...], gen: torch.Generator, scale: float, real_vocab: int
) -> torch.Tensor:
    if kind == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if kind == "bias":
        return 0.1 * torch.randn(shape, generator=gen)
    t = torch.randn(shape, generator=gen) * (scale * INIT_GAIN[kind] / math.sqrt(shape[1]))
    if kind in ("embed", "lm_head"):
        t[real_vocab:] *= PADDING_LOGIT_SCALE
    return t


def _write_weights(
    out: Path,
    config: dict,
    real_vocab: int,
    num_shards: int,
    seed: int,
    scale: float,
    dtype: torch.dtype,
) -> None:
    specs = list(_weight_specs(config))
    total_params = sum(math.prod(shape) for _, shape, _ in specs)
    gen = torch.Generator().manual_seed(seed)
    shards = _split_evenly(specs, num_shards)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    bar = tqdm(
        total=total_params,
        unit="param",
        unit_scale=True,
        desc=f"writing {out.name}",
        disable=total_params < PROGRESS_MIN_PARAMS,
    )
    with bar:
        for k, shard in enumerate(shards):
            name = (
                "model.safetensors"
                if num_shards == 1
                else f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
            )
            tensors = {}
            for tname, shape, kind in shard:
                tensors[tname] = _init_tensor(kind, shape, gen, scale, real_vocab).to(dtype)
                total_bytes += tensors[tname].numel() * tensors[tname].element_size()
                weight_map[tname] = name
                bar.update(math.prod(shape))
            save_file(tensors, str(out / name), metadata={"format": "pt"})
            (out / name).chmod(0o644)
    if num_shards > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)


def _split_evenly(specs: list, num_shards: int) -> list[list]:
    """Consecutive groups of about equal size, each non-empty."""
    sizes = [math.prod(shape) for _, shape, _ in specs]
    target = sum(sizes) / num_shards
    shards: list[list] = [[]]
    filled = 0
    for i, (spec, size) in enumerate(zip(specs, sizes, strict=True)):
        must_open = len(specs) - i <= num_shards - len(shards)
        if (
            shards[-1]
            and len(shards) < num_shards
            and (filled >= target * len(shards) or must_open)
        ):
            shards.append([])
        shards[-1].append(spec)
        filled += size
    return shards


def write_tokenizer(
    out: Path, style: TokenizerStyle, vocab_size: int
) -> tuple[int, list[int], int]:
    """Train a byte-level BPE of at most ``vocab_size`` tokens; return (bos id, eos ids, size).

    "bpe" is Llama-2-like: ``<unk> <s> </s>`` are ids 0-2 and ``tokenizer_config.json`` says
    ``add_bos_token``. "llama3" appends ``<|begin_of_text|> <|end_of_text|> <|eot_id|>`` after the
    learned tokens, splits words with Llama 3's regex, and has two EOS ids. Both write a
    ``tokenizer.json`` whose post-processor prepends BOS, as the real checkpoints do (transformers 5
    ignores ``add_bos_token`` whenever ``tokenizer.json`` exists).
    """
    if style == "bpe":
        specials, bos, eos = LLAMA2_SPECIALS, LLAMA2_SPECIALS[1], LLAMA2_SPECIALS[2]
        pre_tokenizer: pre_tokenizers.PreTokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=False
        )
    elif style == "llama3":
        specials, bos, eos = LLAMA3_SPECIALS, LLAMA3_SPECIALS[0], LLAMA3_SPECIALS[1]
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"tokenizer must be 'bpe', 'llama3' or None, got {style!r}")
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size must be at least {256 + len(specials)}")
    special_tokens = [AddedToken(s, special=True, normalized=False) for s in specials]
    tok = HFTokenizerBackend(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials) if style == "llama3" else vocab_size,
        special_tokens=special_tokens if style == "bpe" else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    if style == "llama3":
        tok.add_special_tokens(special_tokens)
    bos_id = _token_id(tok, bos)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=False, trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)],
            ),
        ]
    )
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    eos_ids = [_token_id(tok, eos)]
    if style == "bpe":
        tokenizer_config.update(add_bos_token=True, add_eos_token=False, unk_token=specials[0])
    else:
        eos_ids.append(_token_id(tok, specials[2]))
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    return bos_id, eos_ids, tok.get_vocab_size()


def _token_id(tok: HFTokenizerBackend, token: str) -> int:
    """The id of ``token``, a special token the tokenizer was trained with or given."""
    token_id = tok.token_to_id(token)
    assert token_id is not None, f"{token!r} is not in the vocabulary"
    return token_id


def _corpus_lines() -> list[str]:
    """The built-in corpus, then shuffles of its words and random numbers (more merges to learn)."""
    lines = CORPUS.splitlines(keepends=True)
    words = CORPUS.split()
    rng = random.Random(0)
    for _ in range(8):
        rng.shuffle(words)
        lines.extend(" ".join(words[i : i + 12]) + "\n" for i in range(0, len(words), 12))
    numbers = [str(rng.randrange(10 ** rng.randrange(1, 7))) for _ in range(400)]
    lines.append(" ".join(numbers) + "\n")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--tokenizer", choices=["bpe", "llama3"], default="bpe")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_random_checkpoint(
        args.out_dir,
        arch=args.arch,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        num_shards=args.num_shards,
        seed=args.seed,
        **PRESETS[args.preset],
    )
    print(out)


if __name__ == "__main__":
    main()
