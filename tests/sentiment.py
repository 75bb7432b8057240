"""A labelled sentiment set for choice constraints: short restaurant reviews, half positive and
half negative, made from banks of adjectives and sentence forms (deterministic).

Used by tests/test_structured_real.py.
"""

from __future__ import annotations

LABELS = ("positive", "negative")
_WORDS = {
    "positive": (
        "wonderful", "delicious", "friendly", "excellent", "amazing",
        "lovely", "perfect", "great", "fantastic", "charming",
    ),
    "negative": (
        "awful", "cold", "rude", "terrible", "disgusting",
        "slow", "dirty", "horrible", "bland", "overpriced",
    ),
}  # fmt: skip
_FORMS = (
    "The food was {a} and the service was {b}.",
    "What a {a} place; the staff were {b}.",
    "Honestly {a}, and the dessert was {b} too.",
    "Our dinner was {a}. Everything felt {b}.",
)
QUESTION = "Is the sentiment of this review positive or negative? Answer with one word."


def reviews(count: int = 40) -> list[tuple[str, str]]:
    """``count`` (review, label) pairs, labels alternating."""
    out = []
    for i in range(count):
        label = LABELS[i % 2]
        words = _WORDS[label]
        text = _FORMS[i % len(_FORMS)].format(a=words[i % 10], b=words[(3 * i + 1) % 10])
        out.append((text, label))
    return out


def completion_prompt(review: str) -> str:
    """A plain prompt whose continuation is the label (a model writes it after a space)."""
    return f"Review: {review}\nSentiment (positive or negative):"


def chat_messages(review: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{QUESTION}\nReview: {review}"}]
