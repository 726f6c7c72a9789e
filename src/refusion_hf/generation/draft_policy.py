"""`DraftPolicy`: how the decoder turns a forward's logits into drafted tokens and confidences.

transformers does the shaping: the hard constraints (`suppress_tokens`, single-token `bad_words_ids` and
`sequence_bias`, `remove_invalid_values`, `renormalize_logits`) and the sampling warpers (`temperature`, `top_k`,
`top_p`, `min_p`, `top_h`, `typical_p`, `epsilon_cutoff`, `eta_cutoff`) are the `LogitsProcessorList`s that
`GenerationMixin._get_logits_processor` builds from the generation config. They are the processors whose output
does not depend on the tokens before the position they score, which is what lets them shape a draft at a position
whose left context is not written yet. Two length constraints are positional and applied here by answer offset
(the same rule stock processors apply by sequence length): no EOS before `min_new_tokens`, no
`begin_suppress_tokens` at the first answer position.

* confidences (slot scores, verification) are probabilities of the constrained logits, never of the warped ones:
  they are the model's belief, not the sampler's;
* drafts are the argmax of the constrained logits (greedy) or a draw from the softmax of the warped ones
  (`do_sample=True`, `torch.multinomial` as in stock sampling); the mask token, and pad / bos when they are not
  EOS, are never drafted.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

_FULL_PRECISION = (torch.float32, torch.float64)  # scores are computed in at least float32


@dataclass
class DraftPolicy:
    never_drafted: torch.LongTensor  # [n] ids no draft may take
    constraints: LogitsProcessorList | None = None  # hard constraints, context-free
    warpers: LogitsProcessorList | None = None  # None: greedy drafting
    eos_ids: torch.LongTensor | None = None  # [e], for `min_new_tokens`
    min_new_tokens: int = 0  # EOS cannot be drafted at answer offsets below this
    begin_suppress: torch.LongTensor | None = None  # ids that cannot be drafted at answer offset 0

    @classmethod
    def greedy(cls, never_drafted: list[int], device) -> DraftPolicy:
        return cls(torch.tensor(sorted(set(never_drafted)), dtype=torch.long, device=device))

    @property
    def samples(self) -> bool:
        """Whether drafts are sampled (each draw consumes the random generator)."""
        return self.warpers is not None

    @property
    def positional(self) -> bool:
        """Whether `scores` needs the answer offset each logits row predicts."""
        return self.min_new_tokens > 0 or self.begin_suppress is not None

    def scores(self, logits: torch.Tensor, offsets: torch.LongTensor | None = None) -> torch.Tensor:
        """logits [n, V] -> constrained scores [n, V] in at least float32. `offsets` [n]: the answer offset
        (position minus prompt length) of the token each row predicts; needed when `positional`."""
        scores = logits if logits.dtype in _FULL_PRECISION else logits.float()
        if self.constraints:
            scores = self.constraints(_no_context(scores), scores)
        if self.positional:
            blocked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
            if self.min_new_tokens > 0:
                blocked[:, self.eos_ids] |= (offsets < self.min_new_tokens)[:, None]
            if self.begin_suppress is not None:
                blocked[:, self.begin_suppress] |= (offsets == 0)[:, None]
            scores = scores.masked_fill(blocked, -float("inf"))
        return scores

    @staticmethod
    def token_probs(scores: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
        """scores [..., V], tokens [...] -> the probability of each token under the softmax of its row, as
        exp(log_softmax(scores)[token]) (one fused kernel over the vocabulary: `logsumexp` takes several)."""
        return scores.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1).exp()

    def draw(self, scores: torch.Tensor) -> torch.LongTensor:
        """Constrained scores [n, V] -> drafted tokens [n]."""
        scores = scores.index_fill(-1, self.never_drafted, -float("inf"))
        if self.warpers is None:
            return scores.argmax(-1)
        warped = self.warpers(_no_context(scores), scores) if self.warpers else scores
        return torch.multinomial(warped.softmax(-1), num_samples=1).squeeze(-1)


def _no_context(scores: torch.Tensor) -> torch.LongTensor:
    """The `input_ids` argument of a context-free processor: one row per scored position, no tokens."""
    return torch.zeros(scores.shape[0], 0, dtype=torch.long, device=scores.device)
