"""A seeded synthetic task suite with checkable answers, small enough for a model trained from scratch on a CPU.

Three families, chosen so that some answers are sequential and some have independent parts:

* `arithmetic`: multi-step word problems (GSM8K-like): each step uses the previous result; the answer ends in
  `#### N` (sequential).
* `code`: short Python functions described in words (MBPP-like), checked by executing asserts in the sandbox.
* `listing`: a list of independent items to transform or a record to format, one line per item (parallel).

Every problem is a chat conversation (`{"role": "user", ...}`) with a reference answer. Determinism and the
split: the problem at `(split, seed, index)` is drawn with a `random.Random` seeded from a SHA-256 of those
values, so it is a pure function of them. Train and test are disjoint by construction, for every pair of seeds:
each problem has a split key (its prompt; for code, the function's identity: description, name and constant, so
that a test function is never trained on with other examples), a key belongs to the test split exactly when a
SHA-256 of it falls in the test bucket (`is_test_key`), and each split rejects (and redraws) problems of the other.

Two tiers (`TIERS`, shapes in `TIER_SHAPES`): `standard`, the suite the embedded model was trained on, and `hard`,
a held-out tier from the same generators that no model here was trained on: always the longest problems of the
training range (three arithmetic steps, five lines) with numbers beyond it (starting amounts 25 to 50 where
training drew 5 to 30, listed numbers 1 to 40 where it drew 1 to 30). Longer problems (four steps, six lines)
were tried first: the controlled AR baseline scored 0 of 40 on them (it stops at the lengths it was trained on), a
tier that measures nothing; on the chosen shape it scores 0.73 and 0.72 (60 problems each of seeds 540001 and
540002, listed in benchmarks/decision_seeds.json). A hard problem is drawn from its own random stream (the tier is
part of the seed's hash); standard problems are the same as before the tier existed.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SPLITS = ("train", "test")
FAMILIES = ("arithmetic", "code", "listing")
TIERS = ("standard", "hard")
TEST_FRACTION_PER_MILLE = 200  # 20% of the prompt space is reserved for the test split
_MAX_ATTEMPTS = 1000


@dataclass(frozen=True)
class TierShape:
    """A tier's problems: ranges (inclusive) of arithmetic steps and starting amount, of record fields, of how many
    numbers a listing transforms and of their values; the families it draws."""

    arithmetic_steps: tuple[int, int]
    arithmetic_start: tuple[int, int]
    record_fields: tuple[int, int]
    listed_numbers: tuple[int, int]
    listed_values: tuple[int, int]
    families: tuple[str, ...]


TIER_SHAPES = {
    "standard": TierShape((2, 3), (5, 30), (3, 5), (3, 5), (1, 30), FAMILIES),
    # the longest problems of the training range, with numbers beyond it (longer ones score 0 for every model here);
    # no code family: its templates have no harder form of the same kind
    "hard": TierShape((3, 3), (25, 50), (5, 5), (5, 5), (1, 40), ("arithmetic", "listing")),
}


@dataclass(frozen=True)
class SyntheticProblem:
    """One problem. `target` is what the metric checks: the number (arithmetic), the assert program (code) or the
    expected answer text (listing)."""

    id: str
    family: str
    prompt: str
    answer: str
    target: str
    entry_point: str | None = None
    visible_tests: tuple[str, ...] = field(default_factory=tuple)
    split_key: str = ""

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]

    def to_training_record(self, record_format: str = "messages") -> dict:
        if record_format == "messages":
            return {"messages": [*self.messages, {"role": "assistant", "content": self.answer}]}
        if record_format == "query":
            return {"query": self.prompt, "response": self.answer}
        raise ValueError(f"`record_format` must be 'messages' or 'query', got {record_format!r}.")


def is_test_key(split_key: str) -> bool:
    """Whether a problem with this split key belongs to the test split (a fixed 20% of keys, by SHA-256)."""
    digest = hashlib.sha256(split_key.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < TEST_FRACTION_PER_MILLE


def _rng(split: str, seed: int, index: int, attempt: int, tier: str = "standard") -> random.Random:
    stream = "refusion-synthetic" if tier == "standard" else f"refusion-synthetic-{tier}"
    key = f"{stream}|{split}|{seed}|{index}|{attempt}".encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


# ------------------------------------------------------------------------------------------ arithmetic
_PEOPLE = (
    ("Ann", "she"),
    ("Ben", "he"),
    ("Cara", "she"),
    ("Dan", "he"),
    ("Eva", "she"),
    ("Finn", "he"),
    ("Gina", "she"),
    ("Hugo", "he"),
    ("Ivy", "she"),
    ("Jack", "he"),
    ("Kim", "she"),
    ("Leo", "he"),
)
_ITEMS = ("apples", "books", "cards", "coins", "eggs", "pens", "shells", "stamps", "stones", "toys")
_CONTAINERS = ("bags", "boxes", "packs", "jars")


def _arithmetic(rng: random.Random, shape: TierShape) -> tuple[str, str, str]:
    name, pronoun = rng.choice(_PEOPLE)
    item = rng.choice(_ITEMS)
    total = rng.randint(*shape.arithmetic_start)
    question = [f"{name} has {total} {item}."]
    work = [f"{name} starts with {total}."]
    for step in range(rng.randint(*shape.arithmetic_steps)):
        then = "Then " if step else ""
        subject = pronoun if step else pronoun.capitalize()
        kind = rng.choice(("buys", "finds", "gives", "loses", "bags"))
        if kind in ("gives", "loses") and total < 4:
            kind = "finds"
        if kind in ("buys", "finds"):
            amount = rng.randint(2, 15)
            question.append(f"{then}{subject} {kind} {amount} more.")
            work.append(f"{total} + {amount} = {total + amount}.")
            total += amount
        elif kind in ("gives", "loses"):
            amount = rng.randint(1, min(15, total - 1))
            verb = "gives away" if kind == "gives" else "loses"
            question.append(f"{then}{subject} {verb} {amount}.")
            work.append(f"{total} - {amount} = {total - amount}.")
            total -= amount
        else:
            count, each = rng.randint(2, 5), rng.randint(2, 9)
            container = rng.choice(_CONTAINERS)
            question.append(f"{then}{subject} buys {count} {container} with {each} {item} in each.")
            work.append(f"{count} * {each} = {count * each}. {total} + {count * each} = {total + count * each}.")
            total += count * each
    question.append(f"How many {item} does {name} have now?")
    work.append(f"#### {total}")
    return " ".join(question), " ".join(work), str(total)


# ------------------------------------------------------------------------------------------------ code
_VERBS = ("get", "make", "find", "compute", "build", "calc")
_NOUNS = ("value", "result", "total", "items", "output", "answer", "score", "data")


def _int_args(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(0, 20) for _ in range(n)]


def _list_args(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randint(0, 9) for _ in range(rng.randint(2, 5))] for _ in range(n)]


def _word_args(rng: random.Random, n: int) -> list[str]:
    letters = "abcdefgh"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 4))) for _ in range(n)]


# (description with {c}, argument name, body with {c}, argument sampler, reference implementation)
_CODE_TEMPLATES: tuple[tuple[str, str, str, Callable, Callable], ...] = (
    ("returns x plus {c}", "x", "return x + {c}", _int_args, lambda x, c: x + c),
    ("returns x times {c}", "x", "return x * {c}", _int_args, lambda x, c: x * c),
    ("returns x minus {c}", "x", "return x - {c}", _int_args, lambda x, c: x - c),
    ("returns True if x is divisible by {c}", "x", "return x % {c} == 0", _int_args, lambda x, c: x % c == 0),
    ("returns True if x is greater than {c}", "x", "return x > {c}", _int_args, lambda x, c: x > c),
    ("returns the sum of the list xs plus {c}", "xs", "return sum(xs) + {c}", _list_args, lambda xs, c: sum(xs) + c),
    (
        "returns the largest element of xs times {c}",
        "xs",
        "return max(xs) * {c}",
        _list_args,
        lambda xs, c: max(xs) * c,
    ),
    (
        "returns the number of elements of xs greater than {c}",
        "xs",
        "return len([x for x in xs if x > {c}])",
        _list_args,
        lambda xs, c: len([x for x in xs if x > c]),
    ),
    (
        "returns a list with every element of xs multiplied by {c}",
        "xs",
        "return [x * {c} for x in xs]",
        _list_args,
        lambda xs, c: [x * c for x in xs],
    ),
    (
        "returns a list with every element of xs plus {c}",
        "xs",
        "return [x + {c} for x in xs]",
        _list_args,
        lambda xs, c: [x + c for x in xs],
    ),
    ("returns the string s repeated {c} times", "s", "return s * {c}", _word_args, lambda s, c: s * c),
    ("returns the first {c} letters of the string s", "s", "return s[:{c}]", _word_args, lambda s, c: s[:c]),
)


def _code(rng: random.Random) -> tuple[str, str, str, str, tuple[str, ...], str]:
    description, arg, body, sampler, reference = rng.choice(_CODE_TEMPLATES)
    name = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
    c = rng.randint(2, 9)
    inputs = sampler(rng, 4)
    asserts = [f"assert {name}({value!r}) == {reference(value, c)!r}" for value in inputs]
    prompt = (
        f"Write a Python function {name}({arg}) that {description.format(c=c)}. "
        f"It must pass: {asserts[0].removeprefix('assert ')}"
    )
    answer = f"def {name}({arg}):\n    {body.format(c=c)}"
    key = f"code|{description}|{name}|{c}"
    return prompt, answer, "\n".join(asserts), name, (asserts[0],), key


# --------------------------------------------------------------------------------------------- listing
_FIELDS = {
    "name": ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gina", "Hugo"),
    "city": ("Rome", "Oslo", "Lima", "Cairo", "Paris", "Delhi", "Tokyo", "Quito"),
    "color": ("red", "blue", "green", "black", "white", "pink"),
    "pet": ("cat", "dog", "fish", "bird", "horse", "rabbit"),
    "food": ("rice", "bread", "soup", "pasta", "cake", "salad"),
    "sport": ("tennis", "golf", "chess", "rugby", "judo", "polo"),
}
_NUMBER_FIELDS = ("age", "room", "level")
_ITEM_RULES = (
    ("add {c} to each number", "{n} plus {c} is {r}", lambda n, c: n + c),
    ("multiply each number by {c}", "{n} times {c} is {r}", lambda n, c: n * c),
    ("subtract {c} from each number", "{n} minus {c} is {r}", lambda n, c: n - c),
)


def _listing(rng: random.Random, shape: TierShape) -> tuple[str, str, str]:
    if rng.random() < 0.5:
        keys = rng.sample(sorted(_FIELDS) + list(_NUMBER_FIELDS), rng.randint(*shape.record_fields))
        values = [str(rng.randint(1, 99)) if key in _NUMBER_FIELDS else rng.choice(_FIELDS[key]) for key in keys]
        record = ", ".join(f"{key} {value}" for key, value in zip(keys, values))
        prompt = f"Write this record as lines of key: value. {record}."
        answer = "\n".join(f"{key}: {value}" for key, value in zip(keys, values))
    else:
        instruction, line, rule = rng.choice(_ITEM_RULES)
        c = rng.randint(2, 9)
        numbers = [rng.randint(*shape.listed_values) for _ in range(rng.randint(*shape.listed_numbers))]
        prompt = f"For the numbers {', '.join(map(str, numbers))}, {instruction.format(c=c)}. Write one line each."
        answer = "\n".join(line.format(n=n, c=c, r=rule(n, c)) for n in numbers)
    return prompt, answer, answer


# --------------------------------------------------------------------------------------------- the suite
def _draw(family: str, rng: random.Random, shape: TierShape) -> dict:
    if family == "arithmetic":
        prompt, answer, target = _arithmetic(rng, shape)
        return {"prompt": prompt, "answer": answer, "target": target, "key": prompt}
    if family == "code":
        prompt, answer, target, entry_point, visible, key = _code(rng)
        return {
            "prompt": prompt,
            "answer": answer,
            "target": target,
            "entry_point": entry_point,
            "visible": visible,
            "key": key,
        }
    prompt, answer, target = _listing(rng, shape)
    return {"prompt": prompt, "answer": answer, "target": target, "key": prompt}


def _check_families(families: Sequence[str] | None, tier: str = "standard") -> tuple[str, ...]:
    allowed = TIER_SHAPES[tier].families
    if families is None:
        return allowed
    families = tuple(families)
    unknown = [f for f in families if f not in allowed]
    if unknown or not families:
        raise ValueError(f"`families` must be a non-empty subset of {allowed} (tier {tier!r}), got {list(families)}.")
    return families


def generate_problem(
    split: str, seed: int, index: int, families: Sequence[str] | None = None, tier: str = "standard"
) -> SyntheticProblem:
    """The problem at `index` of `split` for `seed` and `tier` (families round-robin: index i gets
    families[i % n]; by default the tier's families)."""
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS}, got {split!r}.")
    if tier not in TIERS:
        raise ValueError(f"`tier` must be one of {TIERS}, got {tier!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"`seed` and `index` must be integers, got seed={seed!r}, index={index!r}.")
    if index < 0:
        raise ValueError(f"`index` must be >= 0, got {index}.")
    families = _check_families(families, tier)
    family = families[index % len(families)]
    want_test = split == "test"
    prefix = "synthetic" if tier == "standard" else f"synthetic-{tier}"
    for attempt in range(_MAX_ATTEMPTS):
        drawn = _draw(family, _rng(split, seed, index, attempt, tier), TIER_SHAPES[tier])
        if is_test_key(drawn["key"]) == want_test:
            return SyntheticProblem(
                id=f"{prefix}/{split}/{seed}/{index}",
                family=family,
                prompt=drawn["prompt"],
                answer=drawn["answer"],
                target=drawn["target"],
                entry_point=drawn.get("entry_point"),
                visible_tests=drawn.get("visible", ()),
                split_key=drawn["key"],
            )
    raise RuntimeError(f"no {split} prompt found for family {family!r} in {_MAX_ATTEMPTS} draws")  # pragma: no cover


def generate_problems(
    split: str, n: int, seed: int, families: Sequence[str] | None = None, start: int = 0, tier: str = "standard"
) -> list[SyntheticProblem]:
    """`n` problems of `split` and `tier` drawn with `seed` (indices `start` .. `start + n - 1`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"`n` must be an integer >= 0 (the number of problems), got {n!r}.")
    return [generate_problem(split, seed, index, families, tier) for index in range(start, start + n)]


def write_jsonl(
    path: str | Path,
    split: str,
    n: int,
    seed: int,
    record_format: str = "messages",
    families: Sequence[str] | None = None,
) -> Path:
    """Write `n` problems of `split` as training records, one JSON object per line: `{"messages": [user,
    assistant]}` (default) or `{"query": ..., "response": ...}` with `record_format="query"`. Returns the path."""
    if record_format not in ("messages", "query"):
        raise ValueError(f"`record_format` must be 'messages' or 'query', got {record_format!r}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for problem in generate_problems(split, n, seed, families):
            handle.write(json.dumps(problem.to_training_record(record_format)) + "\n")
    return path
