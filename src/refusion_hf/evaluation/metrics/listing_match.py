"""Exact match of line-by-line (listing / formatting) answers, as a local `evaluate` metric."""

import datasets
import evaluate

from refusion_hf.evaluation.extraction import normalize_listing

_DESCRIPTION = """
Exact match of a listing: both texts are cut into non-empty lines, each stripped, with leading `-` / `*` bullets
removed and inner whitespace collapsed; a prediction is correct when its lines equal the reference's. The partial
score `line_accuracy` is the fraction of reference lines reproduced at their position.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): model answers.
    references (`list` of `str`): expected answers, one item per line.
Returns:
    accuracy (`float`): fraction of exact (normalised) matches.
    line_accuracy (`float`): mean over examples of the fraction of reference lines matched at their position.
    correct (`list` of `bool`): per prediction.
"""


class ListingMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        correct, line_scores = [], []
        for prediction, reference in zip(predictions, references):
            got, want = normalize_listing(prediction), normalize_listing(reference)
            if not want:
                raise ValueError("a reference has no non-empty line: every listing reference needs at least one item.")
            correct.append(got == want)
            line_scores.append(sum(a == b for a, b in zip(got, want)) / len(want))
        count = len(correct)
        return {
            "accuracy": sum(correct) / count if count else 0.0,
            "line_accuracy": sum(line_scores) / count if count else 0.0,
            "correct": correct,
        }
