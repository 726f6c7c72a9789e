"""The transformers releases the package supports (`refusion_hf._compat.transformers`, "Release differences"): the
installed release is one of them, setup.cfg and a model folder's custom_generate/ state the same range, and each
difference between them is what the installed release does. `make test-matrix` runs this file under the oldest and
the newest supported release (noxfile.py)."""

import configparser
import dataclasses
import inspect
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM, Qwen3Model
from transformers.modeling_outputs import CausalLMOutputWithPast

from refusion_hf._compat import check_seam
from refusion_hf._compat import transformers as seam
from refusion_hf.modeling.remote_code import custom_generate_requirements

SEAM = "refusion_hf._compat.transformers"
SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"
SERVE_OWNERS = "transformers.cli.serving"


def test_the_installed_transformers_is_a_supported_release():
    installed = version("transformers")
    assert installed in SpecifierSet(seam.SUPPORTED_RELEASES), (
        f"{SEAM}: transformers {installed} is outside SUPPORTED_RELEASES {seam.SUPPORTED_RELEASES}"
    )


def test_setup_cfg_and_custom_generate_require_the_supported_releases(tmp_path):
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)
    requirements = [Requirement(line) for line in config["options"]["install_requires"].split("\n") if line.strip()]
    (transformers,) = [requirement for requirement in requirements if requirement.name == "transformers"]
    assert transformers.specifier == SpecifierSet(seam.SUPPORTED_RELEASES), (
        f"setup.cfg requires {transformers}, {SEAM}.SUPPORTED_RELEASES is {seam.SUPPORTED_RELEASES}: state one range"
    )
    (tmp_path / "transformers.py").write_text(inspect.getsource(seam))  # the seam as a bundle carries it
    lines = custom_generate_requirements(tmp_path).splitlines()
    assert lines[1:] == ["torch", f"transformers{seam.SUPPORTED_RELEASES}"]


def test_the_declarations_outside_serve_hold_for_the_installed_release():
    """`PRIVATE_MEMBERS` without serve's (which need the `serving` extra, not installed by the matrix until
    `refusion serve` no longer uses them; test_transformers.py checks every declaration under `make test`)."""
    outside_serve = tuple(member for member in seam.PRIVATE_MEMBERS if not member[0].startswith(SERVE_OWNERS))
    check_seam(SimpleNamespace(__name__=SEAM, PRIVATE_MEMBERS=outside_serve))


# ----------------------------------------------------------------------------------------------- the cache's name
def test_cache_name_is_the_installed_forwards_keyword_and_output_field():
    keywords = inspect.signature(Qwen3Model.forward).parameters
    fields = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    assert seam.CACHE_NAME in keywords and seam.CACHE_NAME in fields, (
        f"{SEAM}: CACHE_NAME {seam.CACHE_NAME!r} is not the cache's keyword of the installed Qwen3 forward "
        f"({sorted(keywords)}) nor its output field ({sorted(fields)}); update the seam"
    )


@pytest.fixture(scope="module")
def tiny_qwen3():
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).double().eval()


def test_cache_argument_hands_the_cache_to_a_stock_forward(tiny_qwen3):
    """A forward given `cache_argument(cache)` fills that cache and returns it (`output_cache`), and a second forward
    on it sees the first's tokens: its logits equal the one-shot forward's. A keyword the release does not take
    would run both forwards without it (5.19 drops `cache=` silently)."""
    ids = torch.tensor([[5, 7, 9, 11, 13, 2, 4]])
    cache = DynamicCache(config=tiny_qwen3.config)
    first = tiny_qwen3(input_ids=ids[:, :4], use_cache=True, **seam.cache_argument(cache))
    assert seam.output_cache(first) is cache and cache.get_seq_length() == 4, f"{SEAM}: CACHE_NAME reached no cache"
    second = tiny_qwen3(input_ids=ids[:, 4:], use_cache=True, **seam.cache_argument(cache)).logits
    one_shot = tiny_qwen3(input_ids=ids).logits[:, 4:]
    torch.testing.assert_close(second, one_shot, rtol=1e-10, atol=1e-10)


def test_cache_name_follows_the_output_class():
    """The detection itself: an output class with `past_key_values` (transformers < 5.24) names that, one with
    `cache` names `cache`."""

    @dataclasses.dataclass
    class Before:
        past_key_values: object = None

    @dataclasses.dataclass
    class After:
        cache: object = None

    assert seam.cache_name(Before) == "past_key_values" and seam.cache_name(After) == "cache"
