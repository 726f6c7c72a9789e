"""Stopping criteria applied to the final left-to-right prefix of every row, as stock `generate` applies them.

transformers builds the criteria (`GenerationMixin._get_stopping_criteria`: `max_time`, `stop_strings`, the user's
own); this module only decides when to call them, since ReFusion rows become final out of order.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList

from .sequence_state import SequenceState, Stage
from .transitions import StopAt


class PrefixStopping:
    """Stopping criteria applied to the final left-to-right prefix of every row, as stock `generate` applies them.

    Stock `generate` calls its criteria once per new token, for the whole batch, with `input_ids` of shape
    `[B, prompt_width + t]` (rows that ended are padded), and a row ends where a criterion first fires for it.
    Here a row's prefix becomes final at its own pace, so the criteria are called for answer length t as soon as
    every row still decoding has t final tokens: the same calls, in the same order, with the same inputs, so
    stateful criteria (lm-eval's `MultiTokenEOSCriteria` tracks rows by batch index) work unchanged. `scores` is
    None (ReFusion decoding refuses `output_scores`).
    """

    def __init__(self, criteria: StoppingCriteriaList, input_ids: torch.LongTensor, pad_token_id: int):
        self.criteria = criteria
        self.seen = input_ids  # [B, W + checked]
        self.pad = torch.tensor(pad_token_id, dtype=torch.long, device=input_ids.device)
        self.checked = 0  # answer positions already shown to the criteria

    def update(self, sequences: list[SequenceState]) -> None:
        while any(s.answer_length > self.checked for s in sequences):  # stock stops calling when all rows ended
            decoding = [s.finished_prefix for s in sequences if s.stage is not Stage.DONE]
            if decoding and min(decoding) <= self.checked:
                return  # the next position is not final in every row still decoding
            t = self.checked
            column = torch.stack([s.canvas[t] if t < s.answer_length else self.pad for s in sequences])
            self.seen = torch.cat([self.seen, column[:, None]], dim=1)
            self.checked += 1
            fired = torch.as_tensor(self.criteria(self.seen, None), device=self.seen.device)
            fired = fired.expand(len(sequences)) if fired.dim() == 0 else fired
            for row in fired.nonzero().flatten().tolist():
                if self.checked < sequences[row].answer_length:
                    sequences[row].apply(StopAt(self.checked))
