"""ReFusion decoding inside SGLang: the `ReFusion` `DllmAlgorithm` (`--dllm-algorithm ReFusion`).

SGLang runs the engine (scheduler, paged KV cache, batching of concurrent requests, the OpenAI server, tensor
parallelism); this module is only the per-forward decision: what each request's canvas holds before the next
forward, and when its block is final. SGLang's internals it relies on are declared in `refusion_hf._compat.sglang`;
the plugin that registers it is `sglang_plugin.py`.

How ReFusion maps onto SGLang's canvas (docs/serving.md, "SGLang"): SGLang decodes a request block by block; with
`requires_separate_context_encoding` the block's canvas (`block_size` tokens) sits right after the context (prompt and
answer so far), which SGLang encodes causally, in position order, before each block. Each forward runs the canvas
causally on top of that context. ReFusion's stages for ONE slot are exactly such forwards:

* PLAN: the slot's k mask tokens; each mask predicts its own token (the draft);
* VERIFY: the k drafts; token j passes when its probability given the slot's tokens before it exceeds
  `token_threshold`; the first token is always accepted; the longest passing prefix is verified;
* INFILL: rounds of re-drafting the unverified tail (masks again, own logits) and verifying the slot, until the slot
  is verified whole; an accepted EOS ends the answer there.

The slot's tokens are then emitted in position order and SGLang encodes them causally as context of the next block:
the KV the package's decoder keeps for a committed slot (the slot seeing the cache and itself, causally). So the
configuration SGLang expresses exactly is `block_size == slot_size` (one slot per block: commit order is position
order), without sub-slot remasking. Wider blocks choose slots out of order and verify several slots in one forward
each seeing only the context and itself; SGLang re-encodes a finished block in position order, so their cached KV
would differ from `generate()`'s: the plugin refuses them at launch instead of decoding something else
(`refusion_dllm_config`). Greedy only: a request that samples is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sglang.srt.dllm.algorithm.base import DllmAlgorithm

from refusion_hf._compat import sglang as seam

PLAN, VERIFY, INFILL_DRAFT, INFILL_VERIFY, DONE = "plan", "verify", "infill_draft", "infill_verify", "done"


@dataclass
class SlotDecoding:
    """One request's slot in the current block: the stage its canvas is in, and its verified prefix."""

    stage: str = PLAN
    verified: int = 0

    def advance(self, canvas: list[int], drafts: list[int], passes: list[bool], rule: SlotRule) -> list[int] | None:
        """Host half of one forward for this row. `canvas`: the tokens just forwarded; `drafts`: each position's
        draft (a mask predicts itself); `passes[j - 1]`: whether token j's probability given tokens < j exceeds the
        token threshold. Returns the next canvas (None: unchanged) and moves the stage on."""
        k = len(canvas)
        if self.stage == PLAN:
            self.stage = VERIFY
            return drafts
        if self.stage == INFILL_DRAFT:
            self.stage = INFILL_VERIFY
            return canvas[: self.verified] + drafts[self.verified :]
        if self.stage == DONE:
            return None
        # VERIFY and INFILL_VERIFY: the first unverified token is always accepted, then the run of passing ones
        length = self.verified + 1
        while length < k and passes[length - 1]:
            length += 1
        eos = next((j for j in range(length) if canvas[j] in rule.eos_ids), None)
        if eos is not None:  # the answer ends here; what follows in the slot is not emitted (SGLang stops at EOS)
            self.stage = DONE
            return canvas[: eos + 1] + [canvas[eos]] * (k - eos - 1)
        if length == k:
            self.stage = DONE
            return None
        self.verified, self.stage = length, INFILL_DRAFT
        return canvas[:length] + [rule.mask_id] * (k - length)


@dataclass(frozen=True)
class SlotRule:
    """What the decisions read: the thresholds and the special ids."""

    mask_id: int
    token_threshold: float
    eos_ids: frozenset[int]
    never_drafted: tuple[int, ...] = field(default=())


class ReFusion(DllmAlgorithm):
    """ReFusion's plan / verify / infill for one slot per block (see the module docstring for why)."""

    requires_separate_context_encoding = True  # the block's tokens are re-encoded causally as the next context

    def __init__(self, config):
        super().__init__(config)
        settings = config.algorithm_config
        self.rule = SlotRule(
            mask_id=config.mask_id,
            token_threshold=float(settings["token_threshold"]),
            eos_ids=frozenset(settings["eos_token_ids"]),
            never_drafted=tuple(settings["never_drafted"]),
        )
        self._never = None

    @classmethod
    def configure_server_args(cls, server_args) -> None:
        # Nothing cached across requests is keyed by what only this request's decoding decided.
        seam.declare_server_args(server_args, cls.__name__, disable_radix_cache=True, chunked_prefill_size=-1)

    @classmethod
    def validate_request(cls, req) -> str | None:
        params = req.sampling_params
        if params.top_k == 1 or params.temperature < 1e-6:
            return None
        return (
            "ReFusion on SGLang decodes greedily only: pass temperature=0 (sampling, with temperature "
            f"{params.temperature} and top_k {params.top_k}, is refused rather than ignored)"
        )

    def run(self, model_runner, forward_batch, algo_states=None):
        if not forward_batch.forward_mode.is_dllm_extend():  # the context's causal encoding
            if forward_batch.input_ids.numel() == 0:
                return None, [], None, None, False
            out = model_runner.forward(forward_batch, pp_proxy_tensors=None)
            return out.logits_output, [], None, None, out.can_run_graph
        # SGLang's loop: synchronous (every row of the batch until its block is final) or first-done-first-out
        # (`--dllm-fdfo`, SGLang's default: one forward per scheduler round, a row's state carried between rounds)
        return super().run(model_runner, forward_batch, algo_states)

    def _block_start_list(self, forward_batch) -> list[int]:
        return [0] * forward_batch.batch_size  # the canvas holds no context

    def max_steps(self, block_size: int) -> int:
        return 2 * block_size + 1  # plan, verify, then at most k - 1 infill rounds of two forwards

    def init_step_state(self, forward_batch) -> list[SlotDecoding]:
        return [SlotDecoding() for _ in range(forward_batch.batch_size)]

    def prepare_inputs(self, model_runner, forward_batch, states: list[SlotDecoding]) -> None:
        # A new block's canvas comes from SGLang as placeholders: PLAN forwards the slot as mask tokens.
        planning = [row for row, state in enumerate(states) if state.stage == PLAN]
        if planning:
            canvas = forward_batch.input_ids.view(len(states), self.block_size)
            canvas[planning] = self.rule.mask_id

    def step(self, forward_batch, full_logits, states: list[SlotDecoding]) -> list[bool]:
        rows, k = forward_batch.batch_size, self.block_size
        canvas = forward_batch.input_ids.view(rows, k)
        if self._never is None or self._never.device != full_logits.device:
            self._never = torch.tensor(self.rule.never_drafted, dtype=torch.long, device=full_logits.device)
        scores = full_logits.view(rows, k, -1).float()  # confidences in at least float32, as generate()
        drafts = scores.index_fill(-1, self._never, -float("inf")).argmax(-1)  # [R, k]
        # probability of token j + 1 given the tokens up to j, for every row at once
        next_probs = scores[:, :-1].log_softmax(-1).gather(-1, canvas[:, 1:, None]).squeeze(-1).exp()
        passes = (next_probs > self.rule.token_threshold).tolist()
        canvas_rows, draft_rows = canvas.tolist(), drafts.tolist()
        for row, state in enumerate(states):
            written = state.advance(canvas_rows[row], draft_rows[row], passes[row], self.rule)
            if written is not None:
                canvas[row] = torch.tensor(written, dtype=canvas.dtype, device=canvas.device)
        return [state.stage == DONE for state in states]


Algorithm = ReFusion  # the name SGLang's own algorithm modules export
