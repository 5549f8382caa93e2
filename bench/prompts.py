"""Built-in prompt sets for the benchmarks: input-grounded (the answer copies the input) and free chat."""

from __future__ import annotations

from specfleet.bench.prompt_snippets import CODE_SNIPPETS

PASSAGES = [
    "The scheduler has no prefill or decode phase. Each request's computed tokens catch up with its tokens "
    "within a per-step token budget, and chunked prefill, prefix hits, preemption and speculative tokens all "
    "follow from that one rule. When the cache runs out of blocks, the most recently arrived request is "
    "preempted and later recomputed, mostly from cached prefix blocks.",
    "Our warehouse in Lyon ships every order within two business days. Returns are accepted for thirty days "
    "with a receipt, and damaged goods are replaced free of charge. Customers who need an invoice can "
    "download it from their account page, under Orders, by choosing the order and pressing Invoice.",
    "The river rises in the northern hills, flows south through three villages and a pine forest, and joins "
    "the sea at a wide estuary where herons and egrets feed at low tide. In spring the meltwater floods the "
    "meadows, and farmers move their sheep to the higher pastures until the water recedes.",
    "To reset the router, hold the small button on the back for ten seconds until the light blinks orange. "
    "Wait two minutes for it to restart, then connect to the network named on the label and open the setup "
    "page in a browser. Choose a new password of at least twelve characters and save the settings.",
]


def grounded_prompts() -> list[str]:
    tasks = []
    for passage in PASSAGES:
        tasks.append(f"Repeat the following text exactly, word for word.\n\n{passage}")
        tasks.append(f"Rewrite the following text in British spelling, changing nothing else.\n\n{passage}")
    for code in CODE_SNIPPETS:
        tasks.append(
            f"Add a short comment above the first line of this Python code and return the whole code.\n\n{code}"
        )
    return tasks


TOPICS = [
    "the history of Rome",
    "how volcanoes form",
    "why the sky is blue",
    "the rules of chess",
    "how bread rises",
    "the life of honeybees",
    "how a bicycle stays upright",
    "the water cycle",
    "what makes a good password",
    "how airplanes fly",
    "the origins of jazz",
    "how vaccines work",
]


def chat_prompts() -> list[str]:
    styles = [
        "Tell me about {t}.",
        "Explain {t} to a ten-year-old.",
        "Write a short poem about {t}.",
        "What are three surprising facts about {t}?",
    ]
    return [styles[i % len(styles)].format(t=t) for i, t in enumerate(TOPICS)]
