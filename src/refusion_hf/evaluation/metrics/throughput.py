"""Decoding throughput of a set of `generate` calls, as a local `evaluate` metric."""

import statistics

import datasets
import evaluate

_DESCRIPTION = """
Throughput of a set of `generate` calls, one record per call: the answer length of every sequence in the call
(tokens up to and including EOS), the forward passes each sequence took part in, the model forward passes the call
made, and its wall-clock seconds.

* tokens_per_second = all answer tokens / all seconds (and the median over calls);
* tokens_per_forward = all answer tokens / all per-sequence forward passes (1.0 for autoregressive decoding), and
  the mean of the per-sequence ratios;
* num_forward_passes = model forward calls of all calls (a batched forward counts once).
"""

_KWARGS_DESCRIPTION = """
Args:
    num_tokens (`list` of `list` of `int`): per call, the answer length of each sequence.
    row_forward_passes (`list` of `list` of `int`): per call, the forward passes each sequence took part in.
    num_forward_passes (`list` of `int`): per call, the model forward passes it made.
    seconds (`list` of `float`): per call, its wall-clock time.
Returns:
    tokens_per_second, median_call_tokens_per_second, tokens_per_forward, mean_tokens_per_forward,
    num_forward_passes, num_tokens, num_sequences, seconds.
"""


class Throughput(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "num_tokens": datasets.Sequence(datasets.Value("int64")),
                    "row_forward_passes": datasets.Sequence(datasets.Value("int64")),
                    "num_forward_passes": datasets.Value("int64"),
                    "seconds": datasets.Value("float64"),
                }
            ),
        )

    def _compute(self, num_tokens, row_forward_passes, num_forward_passes, seconds):
        for tokens, passes in zip(num_tokens, row_forward_passes):
            if len(tokens) != len(passes):
                raise ValueError(
                    "`num_tokens` and `row_forward_passes` must list the same sequences per call, got "
                    f"{len(tokens)} and {len(passes)} entries."
                )
            if any(p < 1 for p in passes) or any(t < 0 for t in tokens):
                raise ValueError("every sequence needs >= 1 forward pass and >= 0 tokens.")
        if any(s <= 0 for s in seconds):
            raise ValueError("`seconds` must be > 0 for every call.")
        total_tokens = sum(sum(tokens) for tokens in num_tokens)
        total_row_passes = sum(sum(passes) for passes in row_forward_passes)
        total_seconds = sum(seconds)
        ratios = [t / p for tokens, passes in zip(num_tokens, row_forward_passes) for t, p in zip(tokens, passes)]
        return {
            "tokens_per_second": total_tokens / total_seconds if total_seconds else 0.0,
            "median_call_tokens_per_second": statistics.median(
                sum(tokens) / s for tokens, s in zip(num_tokens, seconds)
            )
            if seconds
            else 0.0,
            "tokens_per_forward": total_tokens / total_row_passes if total_row_passes else 0.0,
            "mean_tokens_per_forward": statistics.fmean(ratios) if ratios else 0.0,
            "num_forward_passes": int(sum(num_forward_passes)),
            "num_tokens": int(total_tokens),
            "num_sequences": len(ratios),
            "seconds": total_seconds,
        }
