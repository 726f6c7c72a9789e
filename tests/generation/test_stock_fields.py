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


def test_knobs_and_stock_fields_are_checked_by_one_mechanism():
    """Issue 56: one check of a value (`ArgumentValues`) for every declared field, knob or stock; each field's
    support is a `Support` (honoured, inert, or refused with its reason), never a bare tag or sentence; the refusal
    names the field with the words its declaration gives."""
    from refusion_hf.generation.refusion_generation_config import KNOBS
    from refusion_hf.generation.stock_fields import INERT, ArgumentValues, Support

    assert all(isinstance(field, ArgumentValues) for field in [*KNOBS, *STOCK_FIELDS.values()])
    assert all(isinstance(field.support, Support) for field in STOCK_FIELDS.values())
    assert {str(field.support) for field in STOCK_FIELDS.values() if field.support.tag == "inert"} == {str(INERT)}
    for name, declared in [*((knob.name, knob) for knob in KNOBS), *((n, STOCK_FIELDS[n]) for n in TYPED)]:
        wrong = 5 if getattr(declared, "kind", None) is STRINGS or getattr(declared, "type", None) is str else "x"
        expected = declared.type_error(wrong)
        with pytest.raises(ValueError) as refusal:
            RefusionGenerationConfig(**{name: wrong})
        assert str(refusal.value) == f"`{name}` must be {expected}, got {wrong!r}.", name
