"""Publishing ReFusion checkpoints: model cards (huggingface_hub `ModelCard`), complete Hub folders, push."""

from .card import DecodingDefaults, build_adapter_card, build_model_card
from .errors import CardInputError, CardSourceError, PublishError, PushError
from .publish import PublishResult, publish, push_folder
from .sources import EvalReport, TrainingSummary, load_eval_report, load_training_summary

__all__ = [
    "CardInputError",
    "CardSourceError",
    "DecodingDefaults",
    "EvalReport",
    "PublishError",
    "PublishResult",
    "PushError",
    "TrainingSummary",
    "build_adapter_card",
    "build_model_card",
    "load_eval_report",
    "load_training_summary",
    "publish",
    "push_folder",
]
