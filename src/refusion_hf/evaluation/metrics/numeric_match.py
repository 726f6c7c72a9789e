"""Numeric exact match with answer extraction (GSM8K-style), as a local `evaluate` metric."""

import datasets
import evaluate

from refusion_hf.evaluation.extraction import extract_numeric_answer, reference_number

_DESCRIPTION = """
Exact match of the final numeric answer. The prediction's answer is extracted as `#### N` (GSM8K's format), else
"The answer is N", else (with `extraction="flexible"`, the default) the last number in the text; numbers are
normalised ("1,000" = "1000", "7.0" = "7"). References are bare numbers or worked answers ending in `#### N`.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): model answers.
    references (`list` of `str`): gold numbers, or GSM8K `answer` fields ending in `#### N`.
    extraction (`str`, defaults to `"flexible"`): `"strict"` accepts only `#### N` / "The answer is N";
        `"flexible"` also falls back to the last number in the text.
Returns:
    accuracy (`float`): fraction of predictions whose extracted number equals the reference's.
    correct (`list` of `bool`): per prediction.
    extracted (`list` of `str` or `None`): the number extracted from each prediction.
Examples:
    >>> metric = evaluate.load("path/to/numeric_match.py")
    >>> metric.compute(predictions=["5 + 3 = 8. #### 8"], references=["8"])["accuracy"]
    1.0
"""


class NumericMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, extraction="flexible"):
        extracted = [extract_numeric_answer(prediction, mode=extraction) for prediction in predictions]
        gold = [reference_number(reference) for reference in references]
        correct = [answer is not None and answer == target for answer, target in zip(extracted, gold)]
        return {
            "accuracy": sum(correct) / len(correct) if correct else 0.0,
            "correct": correct,
            "extracted": extracted,
        }
