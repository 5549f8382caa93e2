"""A checkpoint laid out as the Hub publishes Qwen2.5 and Llama 3, served by `specfleet serve` (the engine's
server process, real sockets) and asked with the official openai client: chat is rendered with the model's
own template (in tokenizer_config.json, as older Qwen and Llama repositories keep it, or in
chat_template.jinja, as transformers now writes it) and generation stops at any id of generation_config.json's
`eos_token_id` list, token for token as transformers' `generate` on the same folder.

The checkpoint is tiny and random (Qwen2: q/k/v bias, tied embeddings; 2 layers, hidden 64) with the bundled
tokenizer, whose `<|im_start|>`/`<|im_end|>` are added special tokens. Random weights seldom pick a real
end-of-turn token, so the list's second id is the first new token transformers' greedy path reaches from its
third step on, as Llama 3's list of three ids works: the run ends at whichever is generated first. A server that
read only config.json's eos id would run to max_tokens; one that rendered another template would count other
prompt tokens and write other text.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from helpers import start_server, stop_process, tiny_config, tiny_model
from specfleet.engine.python_child import python_command
from specfleet.fleet.supervisor import free_port

pytestmark = pytest.mark.slow  # a server process per test

IM_END = 2  # the bundled tokenizer's <|im_end|>, an added special token
# A template of the model's own (not the bundled tokenizer's): its system line shows in the prompt length and
# steers the tokens, so a server that rendered another template is caught by both.
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are Qwen, a tiny random model.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES: Any = [{"role": "user", "content": "Name three colours of the sea."}]
FIRST_STOP = 2  # the earliest greedy step (0-based) whose token may join the eos list: a few tokens of text


def hf_oracle(path: Path) -> tuple[list[int], list[int]]:
    """(prompt ids of MESSAGES under the folder's template, transformers' greedy tokens from them under the
    folder's generation_config.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    rendered: Any = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompt = [int(i) for i in (rendered["input_ids"] if hasattr(rendered, "keys") else rendered)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, pad_token_id=IM_END)
    return prompt, out[0, len(prompt) :].tolist()


def hub_folder(path: Path, bundled_path: Path, template_file: bool) -> tuple[Path, int]:
    """A Qwen2 checkpoint whose chat template is in chat_template.jinja (`template_file`) or in
    tokenizer_config.json, and whose generation_config.json lists two eos ids; and the greedy step at which
    the second ends the run."""
    config = tiny_config("qwen2", tie_word_embeddings=True, eos_token_id=IM_END)
    # seed 2: a greedy path that does not alternate between two tokens from its first step (seeds 0, 1 do)
    tiny_model(config, seed=2, std=0.2).save_pretrained(path)
    (path / "tokenizer.json").write_bytes((bundled_path / "tokenizer.json").read_bytes())
    tokenizer_config = json.loads((bundled_path / "tokenizer_config.json").read_text())
    if template_file:
        (path / "chat_template.jinja").write_text(TEMPLATE)
    else:
        tokenizer_config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    _, free_run = hf_oracle(path)  # generation_config.json: eos IM_END only, which random weights do not pick
    step = next(i for i in range(FIRST_STOP, len(free_run)) if free_run[i] not in free_run[:i])
    assert IM_END not in free_run[: step + 1]
    generation = json.loads((path / "generation_config.json").read_text())
    eos = [IM_END, free_run[step]]
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))
    return path, step


@pytest.mark.parametrize("template_file", [False, True], ids=["tokenizer_config.json", "chat_template.jinja"])
def test_served_chat_uses_the_model_template_and_stops_at_any_eos(
    template_file: bool, bundled_path: Path, tmp_path: Path
) -> None:
    folder, step = hub_folder(tmp_path / "qwen2", bundled_path, template_file)
    assert (folder / "chat_template.jinja").is_file() == template_file
    prompt, expected = hf_oracle(folder)
    assert len(expected) == step + 1  # transformers stops at the list's second id
    proc, url = start_server(
        tmp_path / "server.log",
        "--model",
        f"file://{folder}",
        "--max-model-len",
        "256",
        "--kv-cache-gib",
        "0.05",
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply: Any = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=MESSAGES, temperature=0, max_tokens=32
        )
    finally:
        stop_process(proc)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(expected)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    # the eos token ends the run and is not part of the text (vLLM's behaviour)
    assert choice.message.content == tokenizer.decode(expected[:-1], skip_special_tokens=True)


def test_serve_refuses_a_remote_code_architecture_in_one_line(tmp_path: Path) -> None:
    """InternLM2's config.json names its own configuration code (`auto_map`): `specfleet serve` exits at
    start with the architecture and the supported list, without a traceback and without transformers asking
    on the terminal whether to run that code (the server reads the tokenizer while the core reads the model)."""
    folder = tmp_path / "internlm2"
    folder.mkdir()
    config = {
        "architectures": ["InternLM2ForCausalLM"],
        "model_type": "internlm2",
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    cmd = python_command("-m", "specfleet.engine", "--model", f"file://{folder}", "--port", str(free_port()))
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "architectures=['InternLM2ForCausalLM'] is not supported; supported: LlamaForCausalLM" in output
    assert "Traceback" not in output and "custom code" not in output, output
