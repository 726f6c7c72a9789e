"""The golden tokens SGLang's ReFusion decoding is checked against (tests/serving/test_sglang.py, in .venv-sglang):
`generate()`'s greedy answers, written to tests/data/sglang_golden.json by `python -m tests.serving.sglang_golden`
(in .venv) and re-checked against `generate()` by tests/serving/test_sglang_golden.py in the main suite, so the file
cannot drift from the decoder.

* the embedded model on the first 50 problems of the synthetic suite's test split (chat template), in each of
  `EMBEDDED_CONFIGURATIONS`: its installed decoding (the checkpoint's own settings: block 16, two slots of 8,
  remasking 0.1) and one slot per block without remasking;
* the tiny official-format checkpoint (tests/data/tiny-qwen3-refusion) on the oracle's golden cases of each of
  `ORACLE_CONFIGURATIONS` (one slot per block; two slots per block): the authors' float64 answers.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "sglang_golden.json"
# name -> the settings over the checkpoint's own (`--dllm-algorithm-config`; generate()'s keyword arguments)
EMBEDDED_CONFIGURATIONS = {
    "installed": {},
    "one_slot": {"slot_size": 8, "block_size": 8, "remask_threshold": None},
}
EMBEDDED_PROMPTS = 50
MAX_NEW_TOKENS = 48
# name -> the oracle's configuration (the authors' decoder: no remasking); slot threshold None: any (one slot per block)
ORACLE_CONFIGURATIONS = {
    "one_slot": {"slot_size": 8, "block_size": 8, "token_threshold": 0.0, "slot_threshold": None},
    "two_slots": {"slot_size": 4, "block_size": 8, "token_threshold": 0.0, "slot_threshold": 0.0},
}


def embedded_model_path() -> Path:
    import refusion_hf

    return Path(refusion_hf.__file__).parent / "assets" / "default_model"


def embedded_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from refusion_hf.evaluation.synthetic_tasks import generate_problems

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    problems = generate_problems("test", EMBEDDED_PROMPTS, 0)
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": problem.prompt}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for problem in problems
    ]


def generate_answers(prompts: list[list[int]], settings: dict, max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """generate()'s greedy answers with `settings` (new tokens up to and including the first EOS), float32, batch 1
    each."""
    import torch

    from refusion_hf import RefusionForCausalLM

    model = RefusionForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    answers = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, **settings)[
            0, len(prompt) :
        ].tolist()
        answers.append(out[: out.index(eos) + 1] if eos in out else out)
    return answers


def oracle_cases(configuration: dict) -> list[dict]:
    """The oracle's cases in `configuration` (an `ORACLE_CONFIGURATIONS` entry), with their expected answers."""
    cases = []
    for line in (DATA / "oracle_cases.jsonl").read_text().splitlines():
        case = json.loads(line)
        if case["error"] or case["numerically_sensitive"]:
            continue
        if (case["slot_size"], case["block_length"]) != (configuration["slot_size"], configuration["block_size"]):
            continue
        if case["token_threshold"] != configuration["token_threshold"]:
            continue
        if configuration["slot_threshold"] not in (None, case["slot_threshold"]):
            continue
        tokens = [t for _, t in sorted(zip(case["output_positions"], case["output_ids"], strict=True))]
        eos = 1  # the tiny checkpoint's EOS
        expected = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        cases.append({"id": case["id"], "prompt_ids": case["prompt_ids"], "max_new_tokens": case["gen_length"],
                      "expected": expected[: case["gen_length"]]})  # fmt: skip
    return cases


def oracle_settings(configuration: dict) -> dict:
    """The `--dllm-algorithm-config` mapping of an `ORACLE_CONFIGURATIONS` entry (no remasking: the oracle has none)."""
    settings = {name: configuration[name] for name in ("slot_size", "block_size", "token_threshold")}
    if configuration["slot_threshold"] is not None:
        settings["slot_threshold"] = configuration["slot_threshold"]
    return {**settings, "remask_threshold": None}


def main() -> None:
    prompts = embedded_prompts()
    golden = {
        "embedded": {
            "max_new_tokens": MAX_NEW_TOKENS,
            "prompts": prompts,
            "configurations": {
                name: {"settings": settings, "answers": generate_answers(prompts, settings)}
                for name, settings in EMBEDDED_CONFIGURATIONS.items()
            },
        },
        "oracle": {
            name: {"settings": oracle_settings(configuration), "cases": oracle_cases(configuration)}
            for name, configuration in ORACLE_CONFIGURATIONS.items()
        },
    }
    GOLDEN.write_text(json.dumps(golden) + "\n")
    counts = {name: len(entry["cases"]) for name, entry in golden["oracle"].items()}
    print(GOLDEN, len(prompts), "prompts,", counts, "oracle cases")


if __name__ == "__main__":
    main()
