"""A scripted stand-in for the model, for stage-level tests of the decoder (tests/generation/test_stages.py).

`decode_batch` takes the function that runs one forward (`forward(model, kv, queries, pad_token_id) -> logits
[B, S, V]`, S the widest scored part). `ScriptedForward` is such a function that runs no network: it builds every
scored query token's logits from what a `Belief` says the model believes about that row's answer, so a test
decides exactly what the decoder sees and asserts how it reacts. The decoder itself runs unchanged (its queries,
examination, decisions, commits and ragged-cache bookkeeping); the model only lends its config, for the cache.

What a scored query token predicts (docs/design.md §3): a mask predicts the token at its own position (a plan, a
plan riding along a verification or a re-score, an infill re-draft, or a revision's re-score of a slot's first
token); a written token predicts the token after it (a verification, or a revision's re-score). Each prediction is
a peaked distribution: probability p on one token, the rest spread evenly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tests.oracle import EOS, MASK, PAD

__all__ = ["EOS", "MASK", "PAD", "SURE", "UNSURE", "Belief", "Call", "ScriptedForward"]

SURE = 0.9  # above every threshold the stage tests use
UNSURE = 0.3  # below them


@dataclass(frozen=True)
class Belief:
    """What the scripted model believes about one row's answer, by answer offset (position minus prompt length).

    `answer[o]` is the token it expects at offset o once the token before it is written: a written token at o - 1
    predicts `answer[o]` with probability `follow_p[o]` (so a draft there other than `answer[o]` gets almost
    none), and an infill re-draft (its slot's verified prefix written) drafts `answer[o]` with `draft_p[o]`. A plan
    drafts without its left context: `guess.get(o, answer[o])`, with `draft_p[o]`; a slot's score is its first
    draft's probability. Offsets not listed get `SURE`. Offsets past `answer` are predicted uniformly (no belief).
    """

    answer: list[int]
    draft_p: dict[int, float] = field(default_factory=dict)
    follow_p: dict[int, float] = field(default_factory=dict)
    guess: dict[int, int] = field(default_factory=dict)

    def plan(self, offset: int) -> tuple[int, float] | None:
        if offset >= len(self.answer):
            return None
        return self.guess.get(offset, self.answer[offset]), self.draft_p.get(offset, SURE)

    def redraft(self, offset: int) -> tuple[int, float] | None:
        if offset >= len(self.answer):
            return None
        return self.answer[offset], self.draft_p.get(offset, SURE)

    def follow(self, offset: int) -> tuple[int, float] | None:
        """The token expected at `offset` given the written token before it."""
        if offset >= len(self.answer):
            return None
        return self.answer[offset], self.follow_p.get(offset, SURE)


@dataclass(frozen=True)
class Call:
    """One row of one forward: which prompt it decodes, what it fed after its context (the prompt, on its first
    forward), and what the ragged cache held for the row then."""

    prompt: int  # index of the prompt in `decode_batch`'s list
    tokens: list[int]  # the query's tokens after its context
    offsets: list[int]  # their answer offsets (position minus prompt length)
    cached: int  # kv.lengths of the row: its committed and pending entries
    pending: int  # kv.pending of the row: its pending infill entries
    query: object  # the decoder's `Query`

    @property
    def masks(self) -> int:
        return self.tokens.count(MASK)


class ScriptedForward:
    """`decode_batch`'s `forward`, answering from `beliefs[i]` for the row decoding prompt i.

    The rows of a forward are the prompts decoding, in the order they joined; pass `finished` as `decode_batch`'s
    `on_finish` so that a row that leaves the batch leaves this list too. Every forward is recorded in `calls`.
    """

    def __init__(self, beliefs: list[Belief], vocab_size: int, slot_size: int):
        self.beliefs, self.vocab_size, self.slot_size = beliefs, vocab_size, slot_size
        self.active: list[int] = []  # the prompt decoded by each row of the next forward
        self.prompt_lengths: dict[int, int] = {}
        self.calls: list[list[Call]] = []  # per forward, per row

    def finished(self, index: int, _sequence) -> None:
        self.active.remove(index)

    def __call__(self, model, kv, queries, pad_token_id) -> torch.Tensor:
        if queries[0].num_context and int(queries[0].positions[0]) == 0:  # prompts joining: prefilled in a forward
            # of their own, in prompt order (a revision's re-fed context starts after the prompt)
            first = len(self.prompt_lengths)
            rows = list(range(first, first + len(queries)))
            for index, query in zip(rows, queries):
                self.prompt_lengths[index] = query.num_context
            self.active += rows
        else:
            rows = self.active
        assert len(rows) == len(queries)
        self.calls.append([self._call(i, query, kv, b) for b, (i, query) in enumerate(zip(rows, queries))])
        width = max(query.num_scored for query in queries)
        logits = torch.zeros(len(queries), width, self.vocab_size, dtype=torch.float64)
        for b, (index, query) in enumerate(zip(rows, queries)):
            for j in range(query.num_scored):
                logits[b, j] = self._predict(self.beliefs[index], query, query.num_context + j, index)
        return logits

    def _call(self, index: int, query, kv, row: int) -> Call:
        answer = slice(query.num_context, None)
        offsets = [p - self.prompt_lengths[index] for p in query.positions[answer].tolist()]
        return Call(index, query.tokens[answer].tolist(), offsets, kv.lengths[row], kv.pending[row], query)

    def _predict(self, belief: Belief, query, i: int, index: int) -> torch.Tensor:
        offset = int(query.positions[i]) - self.prompt_lengths[index]
        view = query.pending_view  # [s, 2]: the range of pending tags each scored token sees (None: none)
        hidden = query.hidden  # [s, 2]: positions a scored token must not see (a revision's re-score hides the slot)
        j = i - query.num_context  # among the scored tokens
        if int(query.tokens[i]) != MASK:
            said = belief.follow(offset + 1)
        elif hidden is not None and int(hidden[j, 1] - hidden[j, 0]) > 0:
            said = belief.redraft(offset)  # a revision's mask: the whole block in view, it knows the answer
        elif view is not None and int(view[j, 1] - view[j, 0]) <= self.slot_size:
            said = belief.redraft(offset)  # an infill mask: it sees its own slot's pending entries only
        else:
            said = belief.plan(offset)  # a plan's mask, or the next plan's riding along a verification or re-score
        return self.peaked(*said) if said is not None else torch.zeros(self.vocab_size, dtype=torch.float64)

    def peaked(self, token: int, p: float) -> torch.Tensor:
        """Log-probabilities: p on `token`, the rest evenly on the other tokens."""
        row = torch.full((self.vocab_size,), math.log((1 - p) / (self.vocab_size - 1)), dtype=torch.float64)
        row[token] = math.log(p)
        return row
