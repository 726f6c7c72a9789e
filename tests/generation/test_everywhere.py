"""generate() works through PEFT and in float32 / bfloat16 / float64."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from refusion_hf import RefusionForCausalLM
from tests.oracle import expected, generate_kwargs, load_cases, mismatch

PROMPT = torch.tensor([[32, 24, 53, 31, 52, 63, 5, 38]])
KNOBS = dict(max_new_tokens=24, slot_size=4, block_size=8, slot_threshold=0.6, token_threshold=0.3)


def test_generate_through_peft_lora(fixture_path):
    base = RefusionForCausalLM.from_pretrained(fixture_path, dtype=torch.float64).eval()
    plain = base.generate(PROMPT, **KNOBS)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert torch.equal(peft_model.generate(input_ids=PROMPT, **KNOBS), plain), "fresh LoRA (B = 0) is a no-op"
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    adapted = peft_model.generate(input_ids=PROMPT, return_dict_in_generate=True, **KNOBS)
    assert not torch.equal(adapted.sequences, plain), "the adapter is active inside ReFusion decoding"
    with peft_model.disable_adapter():
        assert torch.equal(peft_model.generate(input_ids=PROMPT, **KNOBS), plain)
    merged = peft_model.merge_and_unload()
    assert type(merged) is RefusionForCausalLM
    assert torch.equal(merged.generate(PROMPT, **KNOBS), adapted.sequences)


def test_float32_reproduces_the_oracle(model32):
    cases = [case for case in load_cases() if expected(case).hole_free]
    failures = []
    for case in cases:
        ids = torch.tensor([case["prompt_ids"]])
        out = model32.generate(ids, return_dict_in_generate=True, **generate_kwargs(case))
        if mismatch(case, out.sequences[0, ids.shape[1] :].tolist(), out.num_forward_passes):
            failures.append(case["id"])
    # float32 rounding flips a near-tie in about one case in 600 (measured when the golden vectors were made).
    assert len(failures) <= 3, failures


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_batches_decode_in_every_dtype(fixture_path, dtype):
    model = RefusionForCausalLM.from_pretrained(fixture_path, dtype=dtype).eval()
    ids = torch.tensor([[0, 0, 32, 24, 53, 31], [61, 61, 33, 51, 20, 31]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **KNOBS)
    assert out.sequences.shape == (2, 6 + 24)
    for row in out.sequences[:, 6:].tolist():
        assert 3 not in row, "no mask token survives"
        if 1 in row:
            assert set(row[row.index(1) + 1 :]) <= {0}
