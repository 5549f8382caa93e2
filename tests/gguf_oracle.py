"""The GGUF oracle of the architecture tests: a tiny random checkpoint (tests/helpers.py) converted by
llama.cpp's own convert_hf_to_gguf.py (bench/llama_convert.py, the pinned sdist that `.ci/setup` puts in the
cache), loaded by the engine with ``quantization="gguf"`` and by transformers' GGUF loader
(``from_pretrained(folder, gguf_file=...)``, which dequantizes every tensor), greedy tokens and each chosen
token's log-probability compared.

Without the converter in the cache the tests skip with the reason; under ``CI=true`` they fail, so CI cannot
skip them silently. Nothing here fetches anything.

transformers' GGUF loader is given the checkpoint's own config: its GGUF config reader leaves out fields the
converter does write (Qwen3's head_dim: the class default 128), and the oracle is about the weights. The
engine reads its config from the file (engine/quant/gguf_source.py), so a field it gets wrong shows as a
mismatch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Token ids below 300: the checkpoints' own sentencepiece vocabulary (write_checkpoint) has 300 pieces.
PROMPTS = [
    [2, 5, 9, 200, 31, 7, 77, 100, 4, 4, 19, 23, 88, 90, 91, 92, 93, 250],
    [42],
    [2, 1, 4, 1, 5, 9, 2, 6],
]
# A vocabulary of 512 over those 300 pieces (the converter pads the rest): transformers' GGUF readers decode
# every vocabulary entry of the file several times per test (config, tokenizer, weights), which for the
# bundled tokenizer's 49152 took most of a test's time.
VOCAB = 512
NEW = 12


def converter_source() -> Path:
    """The converter's llama.cpp tree; skips (fails under CI=true) when `.ci/setup` has not cached it."""
    from specfleet.bench.llama_convert import ConverterMissing
    from specfleet.bench.llama_convert import converter_source as source

    try:
        return source(offline=True)
    except ConverterMissing as e:
        reason = f"llama.cpp's convert_hf_to_gguf.py is not in the cache (.ci/setup fetches it): {e}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def write_checkpoint(path: Path, config: Any, bundled_path: Path, tokenizer: str = "sentencepiece") -> Path:
    """The tiny checkpoint, weights N(0, 0.2), with `tokenizer`:
    - "sentencepiece": a tokenizer.model of 300 pieces trained here on a made-up corpus (give the config
      vocab_size=VOCAB), which every converter here reads but Qwen3-MoE's;
    - "bundled": the bundled SmolLM2's (a BPE tokenizer.json the converter knows by its hash; Qwen3-MoE's
      converter reads only that kind)."""
    from helpers import write_tiny_checkpoint

    bundled = tokenizer == "bundled"
    write_tiny_checkpoint(path, config, std=0.2, tokenizer_from=bundled_path if bundled else None)
    if not bundled:
        _train_sentencepiece(path, pieces=300)
    return path


# Trains a BPE sentencepiece model on a made-up corpus: argv = folder, pieces. Gemma's ids: pad 0, eos 1,
# bos 2, unk 3.
_TRAIN = """
import sys
import sentencepiece as spm
folder, pieces = sys.argv[1], int(sys.argv[2])
words = [f"w{i} tok{i % 37} x{i % 11}y" for i in range(2000)]
corpus = folder + "/corpus.txt"
with open(corpus, "w") as f:
    f.write("\\n".join(" ".join(words[j : j + 12]) for j in range(0, 2000, 12)))
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=folder + "/tokenizer", vocab_size=pieces, model_type="bpe",
    pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2,
)
"""


def _train_sentencepiece(folder: Path, pieces: int) -> None:
    """tokenizer.model in `folder`, trained with the converter's own sentencepiece (installed beside the
    converter's tree, not in the project's environment)."""
    import subprocess

    from specfleet.bench.llama_convert import converter_env
    from specfleet.engine.python_child import python_command

    env = converter_env(converter_source())
    subprocess.run(python_command("-c", _TRAIN, str(folder), str(pieces)), check=True, env=env)
    (folder / "corpus.txt").unlink()
    (folder / "tokenizer.vocab").unlink()


def convert(checkpoint: Path, out_dir: Path, outtype: str) -> Path:
    from specfleet.bench.llama_convert import convert as run

    return run(checkpoint, out_dir / f"model.{outtype}.gguf", outtype, src=converter_source())


def float_model(config: Any) -> Any:
    """transformers over the checkpoint's float32 weights (the oracle where its GGUF loader does not read
    the architecture)."""
    from helpers import tiny_model

    return tiny_model(config, std=0.2)


def transformers_gguf(gguf: Path, config: Any) -> Any:
    """transformers' own GGUF loader over the file, float32, eval."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, config=config, dtype=torch.float32
    )
    return model.eval()


def reference(model: Any, prompts: list[list[int]] = PROMPTS, new: int = NEW):
    """transformers' greedy tokens and each chosen token's log-probability, one prompt at a time."""
    import torch

    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            chosen = out.sequences[0, len(ids) :]
            logits = torch.cat(out.logits).float().log_softmax(-1)
            tokens.append(chosen.tolist())
            logprobs.append(logits.gather(1, chosen[:, None])[:, 0].tolist())
    return tokens, logprobs


def scored(model: Any, prompts: list[list[int]], continuations: list[list[int]]):
    """transformers' log-probabilities of each given continuation token after its prefix, and of its own top
    token there (teacher forcing: one forward pass per prompt)."""
    import torch

    given, best = [], []
    with torch.inference_mode():
        for ids, cont in zip(prompts, continuations):
            logits = model(torch.tensor([ids + cont])).logits[0, len(ids) - 1 : -1].float().log_softmax(-1)
            given.append(logits.gather(1, torch.tensor(cont)[:, None])[:, 0].tolist())
            best.append(logits.max(-1).values.tolist())
    return given, best


def engine(gguf: Path, prompts: list[list[int]] = PROMPTS, new: int = NEW, **options: Any):
    """The engine's greedy tokens and chosen log-probabilities over the file, read with quantization="gguf"
    (native types stay quantized, float32 activations: the reference's dequantized weights times float32);
    `options` go to LLM."""
    from specfleet.engine import LLM, SamplingParams

    llm = LLM(
        model=f"file://{gguf}",
        quantization="gguf",
        quantized_activations="float32",
        block_size=4,
        kv_cache_gib=0.02,
        **options,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0))
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs
