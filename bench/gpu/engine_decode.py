"""Whole-engine decode speed on a random-weight Llama of about 1B parameters, against its roofline.

The model is written once as a Hugging Face folder (config.json, model.safetensors, tokenizer) from a
transformers ``LlamaConfig`` with random weights, then served by ``specfleet.engine.LLM`` through its
public API (``file://`` source). Decode rate = extra tokens / extra time between two generate calls that
differ only in ``max_tokens``, so prefill and start-up cancel out. Roofline: one decode step must read
every weight once (plus the batch's KV context), at the device's measured copy bandwidth.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

# Llama-3.2-1B's shape: 1.24 B parameters with tied embeddings.
FULL = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def write_random_llama(folder: Path, sizes: dict, dtype: torch.dtype, device: torch.device) -> int:
    """Create the HF folder (skipped when already there); return the parameter count."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        **sizes,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
        model.save_pretrained(folder, safe_serialization=True)
        vocab = {f"t{i}": i for i in range(sizes["vocab_size"])}
        tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = WhitespaceSplit()
        PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
        ).save_pretrained(folder)
        del model
    h, i, n, v = (
        sizes["hidden_size"],
        sizes["intermediate_size"],
        sizes["num_hidden_layers"],
        sizes["vocab_size"],
    )
    kv = sizes["num_key_value_heads"] * h // sizes["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return n * per_layer + v * h + h


def measure_decode(
    folder: Path,
    batches: list[int],
    device: str,
    dtype: str,
    steps: tuple[int, int],
    copy_gbs: float,
    num_params: int,
    sizes: dict,
    tensor_parallel_size: int = 1,
) -> dict:
    """Decode tokens/s per batch size against the roofline of one device's copy bandwidth (with TP=N each
    device streams 1/N of the weights, so the roofline is N times higher: reported as measured/roofline)."""
    from specfleet.engine import LLM, SamplingParams

    llm = LLM(
        model=f"file://{folder}",
        attention_backend="triton",
        device=device,
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=min(1024, sizes["max_position_embeddings"]),
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, max(batches) * 16),
        enable_prefix_caching=False,
        **({"kv_cache_gib": 0.05} if device == "cpu" else {}),
    )
    bytes_per_param = torch.finfo(getattr(torch, dtype)).bits // 8
    weight_bytes = num_params * bytes_per_param // tensor_parallel_size  # what one device streams per step
    kv_per_token = (
        2
        * sizes["num_hidden_layers"]
        * sizes["num_key_value_heads"]
        * sizes["hidden_size"]
        // sizes["num_attention_heads"]
        * bytes_per_param
    )
    prompt_len = 16
    result = {
        "weight_bytes": weight_bytes,
        "decode_tok_s": {},
        "roofline_tok_s": {},
        "fraction_of_roofline": {},
    }
    for batch in batches:
        prompts = [[3 + (7 * b + j) % 200 for j in range(prompt_len)] for b in range(batch)]

        def run(max_tokens: int, prompts: list[list[int]] = prompts) -> float:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            if device == "cuda":
                torch.cuda.synchronize()
            assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
            return time.perf_counter() - t0

        run(steps[0])  # warm-up: Triton compiles, allocator settles
        t_short, t_long = run(steps[0]), run(steps[1])
        tok_s = batch * (steps[1] - steps[0]) / max(t_long - t_short, 1e-9)
        mean_context = prompt_len + (steps[0] + steps[1]) / 2
        step_bytes = weight_bytes + batch * mean_context * kv_per_token
        roofline = batch * copy_gbs * 1e9 / step_bytes
        result["decode_tok_s"][str(batch)] = tok_s
        result["roofline_tok_s"][str(batch)] = roofline
        result["fraction_of_roofline"][str(batch)] = tok_s / roofline
        print(
            f"engine decode tp={tensor_parallel_size} batch={batch}: {tok_s:.1f} tok/s, roofline "
            f"{roofline:.1f} tok/s",
            flush=True,
        )
    llm.close()
    return result
