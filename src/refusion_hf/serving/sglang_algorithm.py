"""ReFusion decoding inside SGLang: the `ReFusion` `DllmAlgorithm` (`--dllm-algorithm ReFusion`).

SGLang runs the engine (scheduler, paged KV cache, batching of concurrent requests, the OpenAI server, tensor
parallelism); the decoding decisions are this package's own decoder, unchanged: each request is a
`generation.sequence_state.SequenceState` advanced by the package's stage units (`generation.stages`: plan,
verification, infill, revision), exactly as `generate()` advances it. This module only maps each of the decoder's
forwards onto SGLang's forward of a request's *canvas*, and is the one place that knows SGLang's loop. SGLang's
internals it relies on are declared in `refusion_hf._compat.sglang`; the plugin that registers it is
`sglang_plugin.py`.

How a decoder forward maps onto SGLang (docs/serving.md, "ReFusion on SGLang"):

* SGLang decodes a request block by block: its context (the prompt and every finished block) is in SGLang's KV
  cache, and each forward runs the request's canvas (`CANVAS_BLOCKS` x `block_size` tokens) on top of it, the
  canvas's KV recomputed at every forward. The decoder's cache holds, besides that context, the entries of the
  current block (committed slots, and infill's pending ones), each computed when it was written, seeing what it saw
  then. The canvas is [those entries, recomputed] + [the decoder's query], each token at its own position, under a
  mask that gives every entry what it saw when it was written and every query token what the decoder's query lets
  it see (`BlockLedger`): the attention backend `refusion_torch_native` (`sglang_attention.py`) applies it. So each
  decoder forward is one SGLang forward and computes what `generate()` computes (up to float rounding of
  differently shaped matmuls).
* A block is finished when the decoder closes it: its tokens are emitted (the client sees them) and SGLang encodes
  them as context, in position order, under the mask of what each saw in the decoder (`BlockLedger.close`): the KV
  the decoder keeps for them.
* Planning ahead (`plan_ahead`) is off here: the next plan runs as its own forward (same tokens, more forwards).

Greedy only: a request with `temperature > 0` is refused with a message naming it, and so is a request field that
would shape the drafts (`UNAPPLIED_FIELDS`). A request whose KV SGLang dropped and re-encodes (a retraction) gets its
whole answer encoded under the finished blocks' masks (`context_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sglang.srt.dllm.algorithm.base import DllmAlgorithm

from refusion_hf._compat import sglang as seam
from refusion_hf.generation.draft_policy import DraftPolicy
from refusion_hf.generation.sequence_state import MAX_REVISIONS, SequenceState, Stage
from refusion_hf.generation.stages import STAGES, begin_step, examine_steps, finish_step
from refusion_hf.serving.recomputed_canvas import BlockLedger, CanvasLayout, context_mask, request_settings
from refusion_hf.serving.sglang_names import ATTENTION_BACKEND

# Request fields that would shape the drafts, with their neutral values: refused by name rather than ignored (stop
# strings and stop token ids are SGLang's, applied to the emitted answer as generate()'s stopping criteria are).
UNAPPLIED_FIELDS = {
    "min_new_tokens": (0, None),
    "frequency_penalty": (0.0, None),
    "presence_penalty": (0.0, None),
    "repetition_penalty": (1.0, None),
    "ignore_eos": (False, None),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
}
IDLE_FORWARDS = 4096  # a request's decoding state unseen for this many runs is dropped (the request was aborted)
MAX_ADMITTED = 65536  # admitted requests' budgets kept until they decode


@dataclass
class RequestDecoding:
    """One request's decoding across SGLang's runs: the decoder's state and the current block's entries."""

    state: SequenceState
    ledger: BlockLedger | None
    start_block: int = 0  # the block this run decodes
    last_seen: int = 0
    finished_blocks: list[torch.BoolTensor] = field(default_factory=list)  # each one's `BlockLedger.close` mask


class ReFusion(DllmAlgorithm):
    """ReFusion's decoder on SGLang's canvas (see the module docstring)."""

    requires_separate_context_encoding = True  # each finished block is encoded as context (under its mask)
    required_attention_backend = ATTENTION_BACKEND  # SGLang's torch_native with the canvas's masks
    supported_attention_backends = (ATTENTION_BACKEND,)
    _budgets: dict[str, int] = {}  # request id -> max_new_tokens, recorded when SGLang admits the request

    def __init__(self, config):
        super().__init__(config)
        settings = dict(config.algorithm_config)
        self.knobs = settings.pop("knobs")
        self.block = self.knobs["block_size"]
        self.eos_token_ids = settings.pop("eos_token_ids")
        self.never_drafted = settings.pop("never_drafted")
        self.requests: dict[str, RequestDecoding] = {}
        self.runs = 0
        # the unit serving each stage: the same for every request (its knobs; only its length differs)
        self.units = STAGES.units(request_settings(self.knobs, self.eos_token_ids, self.block))

    @classmethod
    def configure_server_args(cls, server_args) -> None:
        # Nothing cached across requests is keyed by what only this request's decoding decided. (Blocks are decoded
        # synchronously, each to its end in one scheduler round: `refusion_dllm_config` turns SGLang's FDFO off.)
        seam.declare_server_args(server_args, cls.__name__, disable_radix_cache=True, chunked_prefill_size=-1)

    @classmethod
    def validate_request(cls, req) -> str | None:
        params = req.sampling_params
        if not (params.top_k == 1 or params.temperature < 1e-6):
            return (
                "ReFusion on SGLang decodes greedily only: pass temperature=0 (sampling, with temperature "
                f"{params.temperature} and top_k {params.top_k}, is refused rather than ignored)"
            )
        shaping = [name for name, neutral in UNAPPLIED_FIELDS.items() if getattr(params, name, neutral) not in neutral]
        if shaping:
            return (
                f"ReFusion on SGLang does not apply {', '.join(shaping)} (its drafts are the model's argmax): leave "
                "them unset, or serve with `refusion serve`"
            )
        if len(cls._budgets) >= MAX_ADMITTED:  # requests aborted before they decoded: forget the oldest
            del cls._budgets[next(iter(cls._budgets))]
        cls._budgets[req.rid] = int(params.max_new_tokens)
        return None

    # ------------------------------------------------------------------------------------------- SGLang's loop
    def run(self, model_runner, forward_batch, algo_states=None):
        if not forward_batch.forward_mode.is_dllm_extend():  # the context's encoding: a prompt, or a finished block
            if forward_batch.input_ids.numel() == 0:
                return None, [], None, None, False
            attention = seam.attention_backend(model_runner)
            attention.carry(self._finished_block_masks(forward_batch))
            try:
                out = model_runner.forward(forward_batch, pp_proxy_tensors=None)
            finally:
                attention.carry(None)
            return out.logits_output, [], None, None, out.can_run_graph
        return self._decode_block(model_runner, forward_batch)

    def _finished_block_masks(self, forward_batch) -> list[torch.BoolTensor] | None:
        """Per request of a context's encoding: what each new token sees of the others (`context_mask`: a finished
        block under its mask, a prompt causally); None when every request's is causal."""
        new_lengths = forward_batch.extend_seq_lens.tolist()
        starts = forward_batch.extend_prefix_lens.tolist()
        masks, any_mask = [], False
        for rid, start, new in zip(forward_batch.rids, starts, new_lengths):
            decoding = self.requests.get(rid)
            if decoding is None or not decoding.finished_blocks:  # a prompt (its decoding starts after it)
                masks.append(torch.ones(new, new, dtype=torch.bool).tril())
                continue
            prompt = decoding.state.prompt_length
            masks.append(context_mask(prompt, decoding.finished_blocks, start, new))
            any_mask = True
        return masks if any_mask else None

    def _decode_block(self, model_runner, forward_batch):
        self.runs += 1
        rows, width = forward_batch.batch_size, self.block_size
        canvas_positions = forward_batch.positions.view(rows, width)
        decodings = [
            self._decoding(rid, int(canvas_positions[row, 0]), forward_batch.input_ids.device)
            for row, rid in enumerate(forward_batch.rids)
        ]
        final = [None] * rows  # per row, the block's tokens once it is finished

        def finished(row: int) -> bool:
            state = decodings[row].state
            return state.stage is Stage.DONE or state.block != decodings[row].start_block

        attention = seam.attention_backend(model_runner)
        try:
            out = self._forwards(model_runner, forward_batch, attention, decodings, final, finished)
        finally:
            attention.carry(None)
        canvas = forward_batch.input_ids.view(rows, width)
        for row in range(rows):
            canvas[row, : self.block] = torch.tensor(final[row], dtype=canvas.dtype, device=canvas.device)
        emitted = [canvas[row, : self.block] for row in range(rows)]
        logits_output = out.logits_output if out is not None else None
        return logits_output, emitted, None, None, False if out is None else out.can_run_graph

    def _forwards(self, model_runner, forward_batch, attention, decodings, final, finished):
        """Forward every row's decoder query until each row's block is finished; returns the last forward's output."""
        rows, width = forward_batch.batch_size, self.block_size
        out, forwards = None, 0
        limit = 4 * (MAX_REVISIONS + 1) * self.block + 8  # far above a block's forwards: a loop is a bug
        while True:
            active = [row for row in range(rows) if final[row] is None]
            for row in active:
                if finished(row):
                    final[row] = self._emit(forward_batch.rids[row], decodings[row], decodings[row].start_block)
            active = [row for row in active if final[row] is None]
            if not active:
                return out
            if forwards == limit:
                raise RuntimeError("ReFusion on SGLang: a block did not finish")
            steps = {row: begin_step(decodings[row].state, self.units) for row in active}
            layouts = {row: decodings[row].ledger.canvas(steps[row].fed.query, width, self.mask_id) for row in active}
            attention.carry(self._write_canvas(forward_batch, layouts, final))
            out = model_runner.forward(forward_batch, pp_proxy_tensors=None)
            forwards += 1
            logits = out.logits_output.full_logits.view(rows, width, -1)
            counts = [steps[row].fed.query.num_scored for row in active]
            scored = self._scored_logits(logits, active, [layouts[row] for row in active], counts)
            examinations = examine_steps([steps[row] for row in active], scored)
            for row, examination in zip(active, examinations):
                kept = finish_step(steps[row], examination)
                decodings[row].ledger.keep(layouts[row], steps[row].fed.query, kept)

    # ------------------------------------------------------------------------------------------- per request
    def _decoding(self, rid: str, block_start: int, device) -> RequestDecoding:
        decoding = self.requests.get(rid)
        if decoding is None:
            budget = self._budgets.pop(rid, None)
            if budget is None:
                raise RuntimeError(f"request {rid} reached ReFusion's decoding without being admitted by it")
            prompt = torch.zeros(block_start, dtype=torch.long, device=device)  # its tokens are SGLang's context
            settings = request_settings(self.knobs, self.eos_token_ids, budget)
            policy = DraftPolicy.greedy(self.never_drafted, device)
            decoding = self.requests[rid] = RequestDecoding(SequenceState(prompt, settings, policy), None)
        state = decoding.state
        start = state.prompt_length + state.block * state.settings.block_size
        if start != block_start:
            raise RuntimeError(
                f"request {rid}: SGLang's canvas starts at {block_start}, the decoder's block at {start}"
            )
        if decoding.ledger is None or decoding.ledger.block_start != start:
            decoding.ledger = BlockLedger(start)
        decoding.last_seen, decoding.start_block = self.runs, state.block
        if self.runs % 64 == 0:
            for gone in [r for r, d in self.requests.items() if self.runs - d.last_seen > IDLE_FORWARDS]:
                del self.requests[gone]
        return decoding

    def _emit(self, rid: str, decoding: RequestDecoding, block: int) -> list[int]:
        """The finished block's tokens (after the answer's end: its last token repeated, which SGLang's finishing
        rule never reads past), and its mask for SGLang's encoding of it as context."""
        state = decoding.state
        start = block * state.settings.block_size
        end = min(start + state.settings.block_size, state.answer_length)
        tokens = state.canvas[start:end].tolist()
        if state.stage is Stage.DONE:
            self.requests.pop(rid, None)
        else:
            refed = None if state.context is None else state.context_positions.tolist()
            decoding.finished_blocks.append(decoding.ledger.close(len(tokens), refed))
        return tokens + [tokens[-1] if tokens else self.eos_token_ids[0]] * (self.block - len(tokens))

    # ------------------------------------------------------------------------------------------- one forward
    def _write_canvas(self, forward_batch, layouts: dict[int, CanvasLayout], final: list) -> list[torch.BoolTensor]:
        """Write each row's canvas (tokens, positions) into the batch; returns each row's mask."""
        rows, width = forward_batch.batch_size, self.block_size
        tokens, positions, masks = [], [], []
        canvas_positions = forward_batch.positions.view(rows, width)
        for row in range(rows):
            layout = layouts.get(row)
            if layout is None:  # a finished row rides along: its block, seeing itself only
                block_start = int(canvas_positions[row, 0])
                tokens += final[row] + [self.mask_id] * (width - self.block)
                positions += [block_start] * width
                masks.append(torch.eye(width, dtype=torch.bool))
            else:
                tokens += layout.tokens
                positions += layout.positions
                masks.append(layout.mask)
        device = forward_batch.input_ids.device
        forward_batch.input_ids.copy_(torch.tensor(tokens, dtype=forward_batch.input_ids.dtype, device=device))
        forward_batch.positions.copy_(torch.tensor(positions, dtype=forward_batch.positions.dtype, device=device))
        return masks

    @staticmethod
    def _scored_logits(logits: torch.Tensor, rows: list[int], layouts: list[CanvasLayout], counts: list[int]):
        """[R, S, V]: each active row's scored tokens' logits (row r's first `counts[r]`), one gather from the
        forward's logits [rows, W, V]; shorter rows repeat their last."""
        width = max(counts)
        columns = [
            [layout.scored_start + min(j, count - 1) for j in range(width)] for layout, count in zip(layouts, counts)
        ]
        index = torch.tensor(columns, device=logits.device)
        return logits[torch.tensor(rows, device=logits.device)[:, None], index]


Algorithm = ReFusion  # the name SGLang's own algorithm modules export
