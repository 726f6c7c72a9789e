"""Fixtures the serving tests share."""

import pytest

from refusion_hf.modeling.loading import load_model_and_tokenizer
from tests.official_layout import build_official_layout


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """An official-layout checkpoint folder (one per test module) and its model and tokenizer, float32."""
    folder = build_official_layout(tmp_path_factory.mktemp("official") / "model")
    model, tokenizer = load_model_and_tokenizer(str(folder), "float32")
    return str(folder), model, tokenizer
