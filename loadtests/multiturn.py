"""Multi-turn chats over one shared system prompt: the workload a prefix cache is for.

A *conversation* is ``TURNS`` user messages; turn k's request carries the shared system
prompt (about 500 tokens of the default model's tokenizer), every earlier user message
and the answer the service gave to it, and the new user message. Two conversations share
the system prompt's blocks; the turns of one conversation share everything up to their
previous answer. Pure data and functions (no Locust, no HTTP): the Locust users
(``loadtests/chat_locustfile.py``) and the runner (``loadtests.prefix_cache``) share them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from treespark.models.prompts import load_prompts

TURNS = 4

SYSTEM_PROMPT = """\
You are Quill, the support assistant of Northwind Outfitters, a shop that sells outdoor \
clothing, tents, sleeping bags, stoves and climbing gear online and in twelve stores.

How to answer:
1. Be brief and concrete. Answer the question that was asked in two to five sentences, \
then stop. Use a short list only when the customer asks for steps or a comparison.
2. Be honest. If you do not know something, say so and tell the customer where to find \
it; never invent prices, stock levels, delivery dates or order numbers.
3. Be safe. For questions about avalanches, glaciers, rope work, altitude sickness, \
carbon monoxide from stoves or any medical matter, give general guidance only and \
recommend a qualified guide, instructor or doctor.
4. Be kind. Customers often write when something went wrong on a trip; acknowledge it \
once, then help.

What you know about the shop:
- Returns: unused items within 60 days with the receipt; used items within 30 days if \
they are faulty. Tents must be dry and packed in their bag. Refunds go back to the \
original payment method within 5 working days of the return arriving.
- Repairs: the workshop in each store repairs zips, seams, tent poles and down jackets. \
Small repairs are free in the first year; later ones are quoted before any work starts.
- Delivery: standard delivery takes 3 to 5 working days and is free above 50 euros; \
express delivery takes one working day and costs 9 euros. Stoves and fuel canisters \
are shipped without fuel, which must be bought in a store.
- Sizes: jackets and trousers run true to size; climbing shoes run small, so suggest \
half a size to a full size up for all-day comfort and the exact size for hard routes.
- Care: wash waterproof shells at 30 degrees with a technical detergent, never with \
fabric softener, and tumble dry on low heat to restore the water repellency. Store \
sleeping bags loose in a large cotton sack, never compressed.
- Membership: members collect one point per euro; 200 points give a 10 euro voucher. \
Members get free express delivery and early access to the spring and autumn sales.

When the conversation goes on, keep to what was said before: do not repeat earlier \
answers, refer to them. Sign nothing and do not add a greeting to every message."""

FOLLOW_UPS = (
    "Thanks. Can you say that again in fewer words?",
    "What would you do differently in my place?",
    "And if I am on a tight budget?",
    "One more question: what is the most common mistake people make here?",
    "Could you give me a short checklist for that?",
    "Is there anything the shop can help me with for this?",
)


def user_turns(conversation: int, turns: int = TURNS) -> list[str]:
    """The user messages of conversation ``conversation``: a held-out prompt, then
    follow-ups (no conversation repeats another's opening unless there are more
    conversations than prompts)."""
    prompts = [p.text for p in load_prompts("heldout")]
    first = prompts[conversation % len(prompts)]
    rest = [FOLLOW_UPS[(conversation + k) % len(FOLLOW_UPS)] for k in range(turns - 1)]
    return [first, *rest]


def turn_messages(system: str, history: Sequence[tuple[str, str]], user: str) -> list[dict[str, str]]:
    """One turn's request: the system prompt, each earlier (user, answer) pair, the new
    user message."""
    msgs = [{"role": "system", "content": system}]
    for question, answer in history:
        msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return msgs + [{"role": "user", "content": user}]


def prefix_cache_summary(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """From two readings of the cluster's counters (``/metrics``: ``prefix_cache_queries``,
    ``prefix_cache_hits``, ``prompt_tokens``, summed): prompt tokens received, looked up,
    found cached and computed (looked up less found) over the run, the hit rate, and
    computed over received."""
    d = {k: after[k] - before.get(k, 0.0) for k in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens")}
    computed = d["prefix_cache_queries"] - d["prefix_cache_hits"]
    return {
        "prompt_tokens_received": d["prompt_tokens"],
        "prompt_tokens_looked_up": d["prefix_cache_queries"],
        "prompt_tokens_cached": d["prefix_cache_hits"],
        "prompt_tokens_computed": computed,
        "hit_rate": d["prefix_cache_hits"] / d["prefix_cache_queries"] if d["prefix_cache_queries"] else float("nan"),
        "computed_over_received": computed / d["prompt_tokens"] if d["prompt_tokens"] else float("nan"),
    }
