"""Publishing ReFusion checkpoints: model cards (huggingface_hub `ModelCard`), complete Hub folders, push."""

from .card import build_adapter_card, build_model_card, decoding_defaults
from .errors import CardInputError, CardSourceError, PublishError, PushError
from .publish import MODEL_FILE_PATTERNS, PublishResult, PushResult, publish, push_folder
from .sources import EvalReport, TrainingSummary, load_eval_report, load_training_summary

__all__ = [
    "MODEL_FILE_PATTERNS",
    "CardInputError",
    "CardSourceError",
    "EvalReport",
    "PublishError",
    "PublishResult",
    "PushError",
    "PushResult",
    "TrainingSummary",
    "build_adapter_card",
    "build_model_card",
    "decoding_defaults",
    "load_eval_report",
    "load_training_summary",
    "publish",
    "push_folder",
]
