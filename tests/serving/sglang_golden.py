"""The golden tokens SGLang's ReFusion decoding is checked against (tests/serving/test_sglang.py, in .venv-sglang):
`generate()`'s greedy answers, written to tests/data/sglang_golden.json by `python -m tests.serving.sglang_golden`
(in .venv) and re-checked against `generate()` by tests/serving/test_sglang_golden.py in the main suite, so the file
cannot drift from the decoder.

* the embedded model on the first 50 problems of the synthetic suite's test split (chat template), in the one
  configuration SGLang runs exactly: `block_size == slot_size`, no sub-slot remasking (docs/serving.md);
* the tiny official-format checkpoint (tests/data/tiny-qwen3-refusion) on the oracle's golden cases of one such
  configuration (slot = block = 8, token threshold 0): the authors' float64 answers.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "sglang_golden.json"
EMBEDDED_SETTINGS = {"slot_size": 8, "block_size": 8, "remask_threshold": None}
EMBEDDED_PROMPTS = 50
MAX_NEW_TOKENS = 48
ORACLE_SLOT, ORACLE_TOKEN_THRESHOLD = 8, 0.0


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


def generate_answers(prompts: list[list[int]]) -> list[list[int]]:
    """generate()'s greedy answers (new tokens up to and including the first EOS), float32, batch 1 each."""
    import torch

    from refusion_hf import RefusionForCausalLM

    model = RefusionForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    answers = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **EMBEDDED_SETTINGS
        )[0, len(prompt) :].tolist()
        answers.append(out[: out.index(eos) + 1] if eos in out else out)
    return answers


def oracle_cases() -> list[dict]:
    """The oracle's cases in the configuration the tiny checkpoint's engine runs, with their expected answers."""
    cases = []
    for line in (DATA / "oracle_cases.jsonl").read_text().splitlines():
        case = json.loads(line)
        if case["error"] or (case["slot_size"], case["block_length"]) != (ORACLE_SLOT, ORACLE_SLOT):
            continue
        if case["token_threshold"] != ORACLE_TOKEN_THRESHOLD:
            continue
        tokens = [t for _, t in sorted(zip(case["output_positions"], case["output_ids"], strict=True))]
        eos = 1  # the tiny checkpoint's EOS
        expected = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        cases.append({"id": case["id"], "prompt_ids": case["prompt_ids"], "max_new_tokens": case["gen_length"],
                      "expected": expected[: case["gen_length"]]})  # fmt: skip
    return cases


def main() -> None:
    prompts = embedded_prompts()
    golden = {
        "embedded": {
            "settings": EMBEDDED_SETTINGS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "prompts": prompts,
            "answers": generate_answers(prompts),
        },  # fmt: skip
        "oracle": {"slot_size": ORACLE_SLOT, "token_threshold": ORACLE_TOKEN_THRESHOLD, "cases": oracle_cases()},
    }
    GOLDEN.write_text(json.dumps(golden) + "\n")
    print(GOLDEN, len(prompts), "prompts,", len(golden["oracle"]["cases"]), "oracle cases")


if __name__ == "__main__":
    main()
