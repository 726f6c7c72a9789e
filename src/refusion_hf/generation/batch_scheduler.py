"""The batch scheduler: decodes every prompt with ReFusion, one forward per step for all rows (docs/design.md §3).

`decode_batch` drives all sequences in lock step: every loop iteration asks each unfinished sequence's stage for its
query (stages.py), runs ONE model forward for all of them on top of one shared KV cache (ragged_kv_cache.py),
has every row's logits examined and decided, and keeps in the cache what each row keeps. Sequences that finish
leave the batch (their cache rows are dropped), so they cost nothing afterwards; with continuous batching
(`max_rows`) waiting prompts take their places. Stopping criteria see the final prefixes (prefix_stopping.py).
A caller may withdraw prompts while they decode (`withdrawing`: a server whose client went away): before each
forward, a withdrawn prompt that waits is never decoded and one that decodes leaves the batch; and follow each
prompt's final tokens as they are decided (`following`: a server streaming the answers of a `generate_batch` call).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Set
from dataclasses import dataclass

import torch

from .draft_policy import DraftPolicy
from .prefix_stopping import PrefixStopping
from .ragged_kv_cache import RaggedKVCache, forward_queries
from .sequence_state import DecodingSettings, SequenceState, Stage
from .split_attention import split_attention
from .stages import STAGES, StageRegistry, begin_step, examine_steps, finish_step
from .transitions import StopAt

JOIN_FRACTION = 4  # continuous batching: waiting prompts join once 1/JOIN_FRACTION of the rows are free
# The prompts withdrawn from the `decode_batch` calls made in this context (`withdrawing`).
_WITHDRAWN: contextvars.ContextVar[Set[int] | None] = contextvars.ContextVar("refusion_withdrawn", default=None)
# The callback of `following`, for the `decode_batch` calls made in this context.
_FOLLOWER: contextvars.ContextVar[Callable[[int, list[int]], None] | None] = contextvars.ContextVar(
    "refusion_follower", default=None
)


@contextlib.contextmanager
def withdrawing(withdrawn: Set[int]):
    """Within it, a `decode_batch` call (so `generate()` and `generate_batch()` on this thread) reads `withdrawn`, a
    set of prompt indices (rows of `generate()`'s batch; `generate_batch`'s `req_i` is i) that another thread may
    add to while it runs. Before each forward, a withdrawn prompt still waiting is never decoded, and one decoding
    leaves the batch (its cache rows dropped, its place free for a waiting prompt); either answer is empty (length
    0). The check is one `len()` per forward until a prompt is withdrawn: the other rows decode as they would."""
    token = _WITHDRAWN.set(withdrawn)
    try:
        yield withdrawn
    finally:
        _WITHDRAWN.reset(token)


@contextlib.contextmanager
def following(on_final: Callable[[int, list[int]], None]):
    """Within it, a `decode_batch` call (so `generate()` and `generate_batch()` on this thread) calls
    `on_final(index, tokens)` after each forward for every decoding prompt whose final prefix grew (the answer's
    positions before the first undecided one, which no later step changes: what a streamer is sent): `tokens` is
    the new part, token ids in order. Unlike `on_step` it also runs with continuous batching (`max_rows`)."""
    token = _FOLLOWER.set(on_final)
    try:
        yield
    finally:
        _FOLLOWER.reset(token)


@dataclass
class BatchDecodeResult:
    tokens: torch.LongTensor  # [B, A] generated tokens (A = longest answer), pad after each row's answer
    commit_step: torch.LongTensor  # [B, A]
    answer_lengths: list[int]
    forward_passes_per_row: list[int]
    num_forward_passes: int
    chosen_slots: list[list[list[int]]]
    revised_tokens: list[int]  # per row, positions remasked by revisions (0 without `remask_threshold`)
    revision_counts: torch.LongTensor  # [B, A] per generated position, the times a revision remasked it


def decode_batch(
    model,
    prompts: list[torch.LongTensor],
    settings: DecodingSettings,
    pad_token_id: int,
    policy: DraftPolicy | None = None,
    stopping: PrefixStopping | None = None,
    on_step=None,
    forward=None,
    max_rows: int | None = None,
    on_finish=None,
    stages: StageRegistry = STAGES,
) -> BatchDecodeResult:
    """Decode every prompt (unpadded 1-D tensors) with ReFusion; one forward per step serves all rows.

    `policy` turns logits into drafts (default: greedy, never drafting the mask token). `stopping` applies
    stopping criteria to the final prefixes after every forward. `on_step(sequences)` is called after that with
    the list of `SequenceState`s (for streaming). `forward` runs one step's queries (`forward_queries`;
    benchmarks swap in alternative strategies). `stages`: which unit serves each stage (`StageRegistry`; default the
    package's `STAGES`), resolved once for `settings`.

    Continuous batching: with `max_rows`, at most that many prompts decode at once, and as soon as rows finish the
    next prompts take their places (prefilled in a forward of their own, then appended to the shared cache), so
    that a stream of requests longer than the batch keeps it full. `on_finish(index, sequence)` is called when a
    prompt's answer is decoded. Each prompt decodes as it would alone either way. Stopping criteria are called for
    the whole batch at once (stock's contract), so they need every row from the start: not with `max_rows`.
    Prompts withdrawn by the caller (`withdrawing`) end with an empty answer before the next forward.
    """
    device = prompts[0].device
    forward = forward or forward_queries
    units = stages.units(settings)  # the unit serving each stage, for every row of the call
    if policy is None:
        policy = DraftPolicy.greedy([settings.mask_token_id], device)
    if max_rows is not None and (stopping is not None or on_step is not None):
        raise ValueError("continuous batching (`max_rows`) cannot apply batch-wide stopping criteria or stream steps")
    sequences: list[SequenceState | None] = [None] * len(prompts)
    waiting = list(range(len(prompts)))[::-1]  # popped from the end: prompts join in order
    limit = len(prompts) if max_rows is None else max_rows
    active: list[int] = []  # rows of `kv`, in order
    dtype = model.dtype  # read once: `model.dtype` walks the parameters
    kv = RaggedKVCache(model.config, 0, device, dtype)
    num_forward_passes = 0
    withdrawn, seen = _WITHDRAWN.get(), 0  # prompts withdrawn by the caller; how many of them were handled
    follower, followed = _FOLLOWER.get(), [0] * len(prompts)  # `following`: final tokens sent so far, per prompt

    def step(rows: list[int], cache: RaggedKVCache) -> None:
        """One forward for `rows` on `cache`; each row advances and keeps what its stage kept of its query."""
        steps = [begin_step(sequences[row], units) for row in rows]  # 1. each row's stage builds its query
        queries = [step.fed.query for step in steps]
        logits = forward(model, cache, queries, pad_token_id)  # 2. one forward for every row
        context_width = max(q.num_context for q in queries)
        examinations = examine_steps(steps, logits)  # 3. one device-to-host read
        spans = []
        for step, query, examination in zip(steps, queries, examinations):
            kept = finish_step(step, examination)  # 4. each row decides
            # The row's query starts after its left padding in this forward's new cache segment.
            spans.append((context_width - query.num_context, kept))
        cache.keep_new_entries(spans, queries)  # 5. the cache keeps what each row kept

    # The decoding loop runs in inference mode (no autograd bookkeeping on its many small tensor ops), its forwards
    # with the split masks of split_attention.py; the returned tensors are built after it, as ordinary tensors.
    with torch.inference_mode(), split_attention(model):
        while active or waiting:
            if withdrawn is not None and len(withdrawn) != seen:  # one len() per forward until one is withdrawn
                gone = set(withdrawn)  # a copy: the caller's thread may add to it meanwhile
                seen = len(gone)
                for index in [i for i in waiting if i in gone]:  # never decoded: an empty answer
                    sequences[index] = SequenceState(prompts[index], settings, policy)
                for index in [i for i in active + waiting if i in gone]:
                    sequences[index].apply(StopAt(0))
                waiting = [i for i in waiting if i not in gone]
                still = [i for i, row in enumerate(active) if row not in gone]
                if len(still) < len(active):
                    kv.select_rows(still)
                    active = [active[i] for i in still]
            if active:
                step(active, kv)
                num_forward_passes += 1
            joining = []
            # Joining costs a prefill forward of its own: wait until a quarter of the rows are free (or none is busy).
            free = limit - len(active)
            if free < max(1, limit // JOIN_FRACTION) and active:
                free = 0
            while waiting and len(joining) < free:
                index = waiting.pop()
                sequences[index] = SequenceState(prompts[index], settings, policy)
                joining.append(index)
            if joining:
                # Requests that join are prefilled (prompt + first plan) in a cache of their own, so that the rows
                # already decoding are not padded to the prompts' width; their cache rows are appended after.
                fresh = RaggedKVCache(model.config, len(joining), device, dtype)
                step(joining, fresh)
                num_forward_passes += 1
                kv.extend(fresh)
                active.extend(joining)
            if stopping is not None:
                stopping.update(sequences)
            if on_step is not None:
                on_step(sequences)
            if follower is not None:
                for row in active:
                    ready = sequences[row].finished_prefix
                    if ready > followed[row]:
                        follower(row, sequences[row].canvas[followed[row] : ready].tolist())
                        followed[row] = ready
            still = [i for i, row in enumerate(active) if sequences[row].stage is not Stage.DONE]
            if len(still) < len(active):
                if on_finish is not None:
                    for row in active:
                        if sequences[row].stage is Stage.DONE:
                            on_finish(row, sequences[row])
                kv.select_rows(still)
                active = [active[i] for i in still]

        if stopping is not None:
            stopping.update(sequences)  # a cut in the last update may have left later positions of ended rows unchecked
    length = max(sequence.answer_length for sequence in sequences)
    tokens = torch.full((len(sequences), length), pad_token_id, dtype=torch.long, device=device)
    commit_step = torch.full((len(sequences), length), -1, dtype=torch.long, device=device)
    revision_counts = torch.zeros((len(sequences), length), dtype=torch.long, device=device)
    answer_lengths = []
    for row, sequence in enumerate(sequences):
        n = sequence.answer_length
        assert sequence.finished_prefix == n, "ReFusion decoding left a hole before the end of the answer"
        tokens[row, :n] = sequence.canvas[:n]
        commit_step[row, :n] = sequence.commit_step[:n]
        if any(sequence.revisions):
            revision_counts[row, :n] = torch.tensor(list(sequence.revisions[:n]), dtype=torch.long)
        answer_lengths.append(n)
    return BatchDecodeResult(
        tokens=tokens,
        commit_step=commit_step,
        answer_lengths=answer_lengths,
        forward_passes_per_row=[s.forward_passes for s in sequences],
        num_forward_passes=num_forward_passes,
        chosen_slots=[s.trace_chosen for s in sequences],
        revised_tokens=[s.revised_tokens for s in sequences],
        revision_counts=revision_counts,
    )
