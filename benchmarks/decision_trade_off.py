"""ReFusion decoding settings of the embedded model on the decision seeds (540001, 540002 of
benchmarks/decision_seeds.json): accuracy and tokens per forward pass (per row) of each setting, batched by ten
(decoding is batch-invariant; tokens/s against the AR baseline is measured by `refusion eval` on fresh seeds only).

Issue 54's trade: the installed decoding is ~4.6 points behind the AR baseline at ~3.3x its tokens/s on fresh
seeds; which generation-config setting gives accuracy back for speed. As run (one JSON line per setting, prints
only; collected into benchmarks/results/decision_trade_off.json):

    nice -n 10 .venv/bin/python benchmarks/decision_trade_off.py \\
        '{"installed": {}, "tt90": {"token_threshold": 0.9}, ...}' 300 standard

The first argument maps a name to `generate()` keyword arguments over the installed generation config; then
problems per seed and the tier (standard or hard).
"""

import json
import sys
import time

import torch

from refusion_hf.evaluation.lm_eval_tasks.synthetic_suite import is_correct
from refusion_hf.evaluation.synthetic_tasks import generate_problems
from refusion_hf.modeling.loading import load_model_and_tokenizer

DECISION_SEEDS = (540001, 540002)

torch.set_num_threads(1)
model, tok = load_model_and_tokenizer(None, "auto")
tok.padding_side = "left"
configs = json.loads(sys.argv[1])
n = int(sys.argv[2])
tier = sys.argv[3]
problems = [p for s in DECISION_SEEDS for p in generate_problems("test", n, s, families=["arithmetic", "listing"],
                                                                 tier=tier)]  # fmt: skip
texts = [tok.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True) for p in problems]
for name, kw in configs.items():
    t = time.time()
    right = toks = fwd = 0
    for i in range(0, len(texts), 10):
        enc = tok(texts[i : i + 10], return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(0)
        out = model.generate(**enc, max_new_tokens=64, return_dict_in_generate=True, **kw)
        answers = tok.batch_decode(out.sequences[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        toks += int(out.answer_lengths.sum())
        fwd += int(out.forward_passes_per_row.sum())
        right += sum(is_correct(p.family, a, p.target) for p, a in zip(problems[i : i + 10], answers))
    print(json.dumps({"name": name, "kw": kw, "tier": tier, "n": len(problems), "accuracy": right / len(problems),
                      "tokens_per_forward": toks / fwd, "seconds": round(time.time() - t)}), flush=True)  # fmt: skip
