"""ReFusion decoding for stock Qwen3 models through transformers' `custom_generate`, where refusion_hf is not
installed: a stock `Qwen3ForCausalLM` loaded from the official-format checkpoint reproduces the authors' golden
cases and gives exactly what `RefusionForCausalLM.generate` gives."""

import torch
from transformers import StoppingCriteria

from refusion_hf import RefusionForCausalLM
from refusion_hf.modeling.remote_code import CUSTOM_GENERATE_DIR
from tests.bare_env import run_bare
from tests.oracle import CASES_FILE, generate_kwargs, load_cases, mismatch

PROMPT = [[32, 24, 53, 31, 52, 63, 5, 38]]
KNOBS = dict(max_new_tokens=24, slot_size=4, block_size=8, slot_threshold=0.6, token_threshold=0.3)


def test_every_saved_folder_carries_custom_generate(fixture_path, tmp_path):
    RefusionForCausalLM.from_pretrained(fixture_path).save_pretrained(tmp_path)
    folder = tmp_path / CUSTOM_GENERATE_DIR
    assert (folder / "generate.py").is_file() and (folder / "requirements.txt").is_file()
    for path in folder.glob("*.py"):
        for line in path.read_text().splitlines():
            statement = line.strip()
            if statement.startswith("from ."):
                assert (folder / f"{statement.split()[1][1:]}.py").exists(), f"{path.name}: {statement}"
            assert not statement.startswith(("from ..", "from refusion_hf", "import refusion_hf")), line


def test_stock_qwen3_reproduces_the_oracle_through_custom_generate(fixture_path, tmp_path):
    saved = tmp_path / "saved"
    RefusionForCausalLM.from_pretrained(fixture_path).save_pretrained(saved)
    ours = RefusionForCausalLM.from_pretrained(fixture_path, dtype=torch.float64).eval()
    ids = torch.tensor(PROMPT)
    torch.manual_seed(3)
    sampled = ours.generate(ids, do_sample=True, top_k=0, temperature=1.3, **KNOBS).tolist()
    stopped = ours.generate(ids, stopping_criteria=_StopAt(10), **KNOBS).tolist()
    dict_out = ours.generate(ids, return_dict_in_generate=True, **KNOBS)
    result = run_bare(
        f"""
        import json, torch
        from transformers import Qwen3ForCausalLM, StoppingCriteria

        class StopAt(StoppingCriteria):
            def __init__(self, length): self.length = length
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), input_ids.shape[1] - 8 >= self.length)

        model = Qwen3ForCausalLM.from_pretrained({str(fixture_path)!r}, dtype=torch.float64).eval()
        assert type(model) is Qwen3ForCausalLM
        folder = {str(saved)!r}
        def generate(ids, **kwargs):
            return model.generate(torch.tensor(ids), custom_generate=folder, trust_remote_code=True, **kwargs)
        cases = [json.loads(line) for line in open({str(CASES_FILE)!r})]
        out = {{"cases": {{}}}}
        for case in cases:
            knobs = dict(max_new_tokens=case["gen_length"], slot_size=case["slot_size"],
                         block_size=case["block_length"], slot_threshold=case["slot_threshold"],
                         token_threshold=case["token_threshold"])
            result = generate([case["prompt_ids"]], return_dict_in_generate=True, **knobs)
            out["cases"][case["id"]] = [result.sequences[0, len(case["prompt_ids"]):].tolist(),
                                        result.num_forward_passes]
        knobs = {KNOBS!r}
        torch.manual_seed(3)
        out["sampled"] = generate({PROMPT}, do_sample=True, top_k=0, temperature=1.3, **knobs).tolist()
        out["stopped"] = generate({PROMPT}, stopping_criteria=StopAt(10), **knobs).tolist()
        result = generate({PROMPT}, return_dict_in_generate=True, **knobs)
        out["dict"] = [type(result).__name__, result.commit_step.tolist(), result.chosen_slots]
        print(json.dumps(out))
        """,
        tmp_path,
        timeout=600,
    )
    for index, case in enumerate(load_cases()):
        generated, passes = result["cases"][case["id"]]
        assert mismatch(case, generated, passes) is None, case["id"]
        if index % 5 == 0:  # and, beyond the oracle's contract, the very tokens of our class (a sample of cases)
            reference = ours.generate(torch.tensor([case["prompt_ids"]]), **generate_kwargs(case))
            assert generated == reference[0, len(case["prompt_ids"]) :].tolist(), case["id"]
    assert result["sampled"] == sampled, "same random stream, same draws"
    assert result["stopped"] == stopped
    assert result["dict"] == ["RefusionGenerationOutput", dict_out.commit_step.tolist(), dict_out.chosen_slots]


class _StopAt(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - 8 >= self.length)
