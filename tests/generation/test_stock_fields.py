"""Each stock `GenerationConfig` field is declared once (`stock_fields.STOCK_FIELDS`): its support (the honoured
whitelist, inert, or refused with the reason), the kind of value and the range it takes; the refusals
(`ARGUMENT_SUPPORT`), the config's whitelist and docstring and its type and range checks follow from it."""

import pytest

from refusion_hf import RefusionGenerationConfig
from refusion_hf.generation.generate_arguments import ARGUMENT_SUPPORT, HONOURED
from refusion_hf.generation.stock_fields import STOCK_FIELDS, STRINGS

TYPED = [name for name, field in STOCK_FIELDS.items() if field.kind is not None]
RANGED = [name for name, field in STOCK_FIELDS.items() if field.low is not None]


def test_the_whitelist_is_the_honoured_fields():
    honoured = [name for name, support in ARGUMENT_SUPPORT.items() if support == HONOURED]
    assert list(RefusionGenerationConfig.honoured_fields) == honoured
    documented = " ".join(RefusionGenerationConfig.__doc__.split())
    assert "honoured by ReFusion decoding: " + ", ".join(f"`{name}`" for name in honoured) + "." in documented
    assert not {"num_beams", "repetition_penalty", "use_cache"} & set(RefusionGenerationConfig.honoured_fields)


@pytest.mark.parametrize("decoding", ["refusion", "autoregressive"])
@pytest.mark.parametrize("name", TYPED)
def test_a_value_of_the_wrong_kind_is_refused_by_name(name, decoding):
    wrong = 5 if STOCK_FIELDS[name].kind is STRINGS else "x"
    with pytest.raises(ValueError, match=rf"^`{name}` must be "):
        RefusionGenerationConfig(**{name: wrong}, decoding=decoding)


@pytest.mark.parametrize("name", RANGED)
def test_a_value_outside_the_declared_range_is_refused_by_name(name):
    field = STOCK_FIELDS[name]
    below = field.low - 1 if field.kind is int else field.low - 0.5
    with pytest.raises(ValueError, match=rf"^`{name}` must be (>= |in \[){field.low}"):
        RefusionGenerationConfig(**{name: below})
    RefusionGenerationConfig(**{name: field.low})  # the bound itself is inside
    if field.high is not None:
        with pytest.raises(ValueError, match=rf"^`{name}` must be in \[{field.low}, {field.high}\]"):
            RefusionGenerationConfig(**{name: field.high + 0.5})
