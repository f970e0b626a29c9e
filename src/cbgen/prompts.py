"""Built-in chat instructions, shared by the demo and the benchmark workloads (deterministic)."""

from __future__ import annotations

CHAT_INSTRUCTIONS: list[str] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is to a ten-year-old.",
    "Give me three tips for writing clean Python code.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Why is the sky blue? Answer briefly.",
    "Write a short, friendly email declining a meeting invitation.",
    "List five fruits that are rich in vitamin C.",
    "What does a CPU cache do, and why does it make programs faster?",
    "Describe photosynthesis in simple terms.",
    "Give a recipe for a quick vegetable soup.",
    "What are the main causes of the seasons on Earth?",
    "Write a limerick about a cat who loves to code.",
    "Explain the difference between weather and climate.",
    "How do I reverse a string in Python? Show code.",
    "What is the Pythagorean theorem? Give an example.",
    "Suggest a name for a bakery that specialises in sourdough bread.",
    "What are three benefits of regular exercise?",
    "Explain recursion with a short example.",
    "Write a two-sentence horror story.",
    "What is machine learning, in one paragraph?",
    "How many continents are there, and what are they called?",
    "Give me a motivational quote and explain what it means.",
    "What is the boiling point of water at sea level in Celsius and Fahrenheit?",
    "Write a short poem about autumn leaves.",
    "Explain how a bicycle stays upright when it moves.",
    "What is the difference between RAM and disk storage?",
    "Describe the water cycle step by step.",
    "Give three ideas for a rainy-day activity with children.",
    "What is an API? Explain with an everyday analogy.",
]

SYSTEM_PROMPTS: list[str] = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in as few words as possible while staying correct and polite.",
    (
        "You are a patient teacher who explains ideas step by step. Use simple words, short sentences and "
        "one concrete example. If the question is ambiguous, state your assumption before answering. Avoid "
        "jargon; when a technical term is unavoidable, define it in plain language the first time it appears."
    ),
    (
        "You are a careful technical writer working for a company that builds developer tools. Your answers "
        "are read by engineers who are busy, so lead with the answer, then give the reasoning, then any caveats. "
        "Prefer lists when there are several items. Use code blocks for code. Never invent APIs or facts: when "
        "you are not sure, say so and suggest how the reader could check. Keep a friendly, professional tone, "
        "and end with a one-line summary that starts with 'In short:'. Remember that many readers are not native "
        "English speakers, so avoid idioms and cultural references that might not translate well."
    ),
]


def chat_conversations(count: int) -> list[list[dict[str, str]]]:
    """``count`` deterministic conversations: every instruction paired with each system prompt in turn."""
    convs = []
    for i in range(count):
        system = SYSTEM_PROMPTS[(i // len(CHAT_INSTRUCTIONS) + i) % len(SYSTEM_PROMPTS)]
        user = CHAT_INSTRUCTIONS[i % len(CHAT_INSTRUCTIONS)]
        convs.append([{"role": "system", "content": system}, {"role": "user", "content": user}])
    return convs
