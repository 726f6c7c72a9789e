"""`refusion_generate_batch(model, ...)`: `generate_batch()` with ReFusion decoding, in numbered steps like `generate`.

transformers' continuous-batching interface (a list of prompts in, `{"req_0": GenerationOutput, ...}` out) on the
ragged-cache decoder: after its own refusals, the prompts are left-padded into one batch and go through the steps of
`generate()` (`refusion_generate.generate_steps`), with `decode_batch` letting the next request take a finished row's
place. transformers does the rest: its `GenerationOutput` and, with `decoding="autoregressive"`, its own
`GenerationMixin.generate_batch` on its paged cache.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin

from .generate_arguments import BATCH_SIGNATURE, REFUSE_SUFFIX, bound_arguments, check_integer_ids, eos_token_ids
from .refusion_generate import DEFAULT_BATCH_ROWS, generate_steps, merged_config, stock_keywords
from .stock_fields import STOCK_ARGUMENTS, STOCK_BATCH_ARGUMENTS


def refusion_generate_batch(model, *args, **kwargs) -> dict:
    """`model.generate_batch(...)` with ReFusion decoding: transformers' continuous-batching interface (a list of
    prompts in, `{"req_0": GenerationOutput, ...}` out in input order) on the ragged-cache decoder. At most
    `continuous_batching_config.max_requests_per_batch` requests (default `DEFAULT_BATCH_ROWS`) decode at once;
    when one finishes, the next takes its place. Generation-config fields and keyword overrides mean what they
    mean in `generate()`; `decoding="autoregressive"` hands the call to transformers' own `generate_batch`.
    `warmup` has nothing to do here (no CUDA graphs are captured). Refused: `record_timestamps` (tokens are
    committed out of order), `persistent_manager` (there is no background manager), the paged-cache fields of
    `continuous_batching_config`, stopping criteria (see `decode_batch`), a config marked `is_assistant` (stock
    assisted decoding drafts through `generate()`) and what the list of prompts stands for
    (`input_ids`, `inputs_embeds`, `attention_mask`, `return_dict_in_generate`, `custom_generate`). The signature is
    stock `GenerationMixin.generate_batch`'s (`BATCH_SIGNATURE`, from `stock_fields.STOCK_BATCH_ARGUMENTS`)."""
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    call = bound_arguments(BATCH_SIGNATURE, (model, *args), kwargs)
    inputs, generation_config, kwargs = call["inputs"], call["generation_config"], call["kwargs"]
    continuous_batching_config = call["continuous_batching_config"]
    # 1. The decoding method, from the config merged once (as generate() merges it): `decoding="autoregressive"` is
    #    transformers' own generate_batch, with the keywords generate() hands to stock generate.
    config, model_kwargs = merged_config(model, generation_config, kwargs)
    if config.decoding == "autoregressive":
        stock_kwargs = stock_keywords(generation_config, kwargs)
        ignored = sorted(set(stock_kwargs) - {"max_new_tokens"})
        if ignored:  # transformers' generate_batch reads only `max_new_tokens` from its keyword arguments
            raise ValueError(
                f"`generate_batch(decoding='autoregressive')` would ignore {ignored}: transformers' own "
                "generate_batch reads only `max_new_tokens` as a keyword; put the rest in `generation_config`."
            )
        named = {name: call[name] for name in STOCK_BATCH_ARGUMENTS}
        return GenerationMixin.generate_batch(model, inputs, generation_config, **named, **stock_kwargs)

    # 2. Refuse what a continuous batch cannot honour.
    lengths = [n for n in ("max_length", "min_length") if kwargs.get(n) is not None]
    lengths += [n for n in ("max_length", "min_length") if getattr(generation_config, n, None) is not None]
    if lengths:
        raise ValueError(
            f"`generate_batch` takes lengths per request: `{lengths[0]}` would count a padded prompt that requests "
            "do not have; pass `max_new_tokens` / `min_new_tokens`."
        )
    given = [n for n in ("stop_strings", "max_time") if getattr(config, n, None) is not None]
    given += [n for n in ("stopping_criteria", "streamer") if kwargs.get(n)]
    if given:
        raise ValueError(
            f"`generate_batch` cannot apply `{given[0]}`: stopping criteria are called for the whole batch at once, "
            "and a continuous batch changes as requests come and go (streamers follow one sequence); cut the "
            "answers afterwards, or use `generate()`."
        )
    if getattr(generation_config, "is_assistant", False):  # set by stock assisted decoding on its assistant
        raise ValueError(
            "`generate_batch` drafts nothing for assisted decoding (`generation_config.is_assistant` is set): stock "
            "assisted decoding asks its assistant through `generate()`; unset `is_assistant` to decode requests."
        )
    for name, argument in STOCK_BATCH_ARGUMENTS.items():
        if argument.support.is_refused and call[name]:  # set (each defaults to False)
            raise ValueError(
                f"`generate_batch({name}={call[name]!r})` is not supported by ReFusion decoding; {REFUSE_SUFFIX}"
            )
    for name in ("input_ids", "inputs_embeds", "attention_mask", "return_dict_in_generate", "custom_generate"):
        if name in kwargs:
            raise ValueError(
                f"`generate_batch` takes no `{name}`: the prompts are `inputs` (lists of token ids) and the answers "
                "are transformers' `GenerationOutput`s; use `generate()` for the rest."
            )
    rows = DEFAULT_BATCH_ROWS
    if continuous_batching_config is not None:
        default = type(continuous_batching_config)()
        for name, value in vars(continuous_batching_config).items():
            if name != "max_requests_per_batch" and value != getattr(default, name, value):
                raise ValueError(
                    f"`continuous_batching_config.{name}` configures transformers' paged cache, which ReFusion "
                    "decoding does not use: leave it unset (`max_requests_per_batch` sets the rows decoded at once)."
                )
        rows = continuous_batching_config.max_requests_per_batch or rows

    # 3. The prompts, checked as generate() checks `input_ids`, left-padded into one batch.
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise ValueError("`inputs` must be a non-empty list of prompts, each a list of token ids.")
    prompts = []
    for index, prompt in enumerate(inputs):
        try:
            ids = torch.as_tensor(list(prompt))
        except (TypeError, ValueError, RuntimeError):  # not a sequence, not numbers, or beyond int64
            ids = None
        if ids is None or ids.ndim != 1 or ids.numel() == 0:
            raise ValueError("every prompt of `inputs` must be a non-empty list of token ids.")
        check_integer_ids(f"inputs[{index}]", ids)
        prompts.append(ids.long())
    pad = config.pad_token_id if config.pad_token_id is not None else eos_token_ids(config)[0]
    width = max(p.numel() for p in prompts)
    input_ids = torch.full((len(prompts), width), int(pad), dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - prompt.numel() :], attention_mask[row, width - prompt.numel() :] = prompt, 1

    # 4. `generate()`'s steps on the padded batch, at most `rows` rows decoding at once.
    progress = None
    if call["progress_bar"]:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(prompts), desc=f"Solving {len(prompts)} requests", unit="request")
    stock_arguments = {name: model_kwargs.pop(name, None) for name in STOCK_ARGUMENTS}
    config.return_dict_in_generate = True
    model_kwargs["attention_mask"] = attention_mask
    on_finish = (lambda index, sequence: progress.update(1)) if progress is not None else None
    merged = (config, model_kwargs)
    output = generate_steps(
        model, input_ids, generation_config, stock_arguments, None, kwargs, merged, max_rows=rows, on_finish=on_finish
    )
    if progress is not None:
        progress.close()

    # 5. The answers as transformers' `GenerationOutput`s, by request id (`num_return_sequences` adds children).
    results = {}
    repeats = output.sequences.shape[0] // len(prompts)
    for row in range(output.sequences.shape[0]):
        prompt, child = divmod(row, repeats)
        request_id = f"req_{prompt}" if child == repeats - 1 else f"req_{prompt}__child#{child}"
        length = int(output.answer_lengths[row])
        results[request_id] = GenerationOutput(
            request_id=request_id,
            prompt_ids=list(inputs[prompt]),
            generated_tokens=output.sequences[row, width : width + length].tolist(),
            status=RequestStatus.FINISHED,
        )
    return results


refusion_generate_batch.__signature__ = BATCH_SIGNATURE
