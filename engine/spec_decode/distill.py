"""`specfleet draft distill`: train a small draft on the target's own greedy outputs, on CPU.

1. The target (this engine) answers a deterministic set of chat prompts greedily: the teacher data.
2. The draft starts as the target's first L layers (embeddings, final norm and tied head shared and
   frozen) and is trained to predict the teacher's next token on the answers, for a time budget.
3. The result is written as a Hugging Face folder (config, safetensors, tokenizer) usable as
   `--draft-model file://DIR`, and its greedy agreement with the target is measured on held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from specfleet.engine.spec_decode.make_draft import truncate_layers

SUBJECTS = [
    "the ocean",
    "ancient Egypt",
    "a lighthouse keeper",
    "machine learning",
    "the moon landing",
    "coffee",
    "mountains",
    "a lost cat",
    "electric cars",
    "the printing press",
    "rainforests",
    "the human heart",
    "a busy train station",
    "photosynthesis",
    "the stock market",
    "dinosaurs",
    "a rainy afternoon",
    "the internet",
    "soccer",
    "medieval castles",
    "the solar system",
    "gardening",
    "a first job",
    "recycling",
    "friendship",
    "the Great Wall",
    "thunderstorms",
    "a bakery",
    "robots",
    "deserts",
    "the piano",
    "winter holidays",
    "earthquakes",
    "a detective",
    "space travel",
    "tea",
]
STYLES = [
    "Tell me about {s}.",
    "Write a short story about {s}.",
    "Explain {s} simply.",
    "Give me three facts about {s}.",
    "Write a poem about {s}.",
    "Why is {s} interesting?",
    "Describe {s} in a paragraph.",
    "What should a beginner know about {s}?",
]
# Held-out prompts for the agreement measurement: none is a teacher prompt (they were the first six of the
# benchmark's chat prompts when the documented figures were measured; the engine does not import bench/).
HELD_OUT = [
    "Tell me about the history of Rome.",
    "Explain how volcanoes form to a ten-year-old.",
    "Write a short poem about why the sky is blue.",
    "What are three surprising facts about the rules of chess?",
    "Tell me about how bread rises.",
    "Explain the life of honeybees to a ten-year-old.",
]


def teacher_data(target: str, num_prompts: int, max_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt + answer token ids, prompt length) for greedy answers of the target."""
    from specfleet.engine import LLM, SamplingParams

    rng = random.Random(seed)
    prompts = [rng.choice(STYLES).format(s=rng.choice(SUBJECTS)) for _ in range(num_prompts)]
    llm = LLM(model=target, max_num_seqs=64)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    results = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    return [(r.prompt_token_ids + r.outputs[0].token_ids, len(r.prompt_token_ids)) for r in results]


def train(
    draft_dir: Path, data: list[tuple[list[int], int]], minutes: float, batch_size: int, lr: float, seed: int
) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    model.train()
    model.get_input_embeddings().weight.requires_grad_(False)  # tied with the head: shared, frozen
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    deadline = time.monotonic() + minutes * 60
    steps, losses = 0, []
    bar = tqdm(desc="distill", unit="step")
    while time.monotonic() < deadline:
        batch = rng.sample(data, min(batch_size, len(data)))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.full_like(input_ids, -100)
        for row, (ids, prompt_len) in enumerate(batch):
            labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        steps += 1
        losses.append(float(loss))
        bar.set_postfix(loss=f"{statistics.fmean(losses[-20:]):.3f}")
        bar.update(1)
    bar.close()
    model.eval()
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, draft_dir / "model.safetensors", metadata={"format": "pt"})
    return {"steps": steps, "final_loss": statistics.fmean(losses[-20:]) if losses else None}


def agreement(target: str, draft_dir: Path, k: int, max_tokens: int) -> float:
    from specfleet.engine import LLM, SamplingParams

    llm = LLM(
        model=target, speculative_method="draft", draft_model=f"file://{draft_dir}", num_speculative_tokens=k
    )
    llm.chat(
        [[{"role": "user", "content": p}] for p in HELD_OUT],
        SamplingParams(temperature=0, max_tokens=max_tokens),
    )
    return llm.engine.stats.acceptance_rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specfleet draft distill", description=__doc__)
    parser.add_argument("--target", default="bundled://smollm2-135m-instruct")
    parser.add_argument("--out", required=True, help="folder for the draft (Hugging Face format)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--minutes", type=float, default=15.0, help="training time budget")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    out = Path(args.out)
    started = time.monotonic()
    truncate_layers(args.target, args.layers, out)
    before = agreement(args.target, out, 4, 64)
    data = teacher_data(args.target, args.num_prompts, args.max_tokens, args.seed)
    report = train(out, data, args.minutes, args.batch_size, args.lr, args.seed)
    after = agreement(args.target, out, 4, 64)
    report.update(
        {
            "layers": args.layers,
            "teacher_tokens": sum(len(i) - p for i, p in data),
            "acceptance_before": before,
            "acceptance_after": after,
            "minutes_total": (time.monotonic() - started) / 60,
        }
    )
    (out / "specfleet-distill.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
