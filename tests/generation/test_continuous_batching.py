"""Continuous batching (`generate_batch`, `decode_batch(max_rows=...)`): a stream of requests longer than the batch
keeps the batch full, finished rows' places go to the next requests at once, and every request decodes exactly as
it does alone."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.configuration_utils import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from tests.generation.test_batching import batches

EOS = 1


def answer_alone(model, prompt, **knobs):
    """The answer `generate()` gives the prompt alone: up to and including its EOS."""
    new = model.generate(torch.tensor([prompt]), **knobs)[0, len(prompt) :].tolist()
    return new[: new.index(EOS) + 1] if EOS in new else new


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches(), rows=st.integers(1, 3), extra=st.lists(st.lists(st.integers(4, 63), min_size=1, max_size=9)))
def test_every_request_decodes_as_alone(model32, batch, rows, extra):
    prompts, knobs = batch
    prompts = prompts + extra[:3]
    config = ContinuousBatchingConfig(max_requests_per_batch=rows)
    results = model32.generate_batch(prompts, continuous_batching_config=config, **knobs)
    assert list(results) == [f"req_{i}" for i in range(len(prompts))]  # input order, transformers' ids
    for index, prompt in enumerate(prompts):
        result = results[f"req_{index}"]
        assert result.prompt_ids == prompt and result.status == RequestStatus.FINISHED
        assert result.generated_tokens == answer_alone(model32, prompt, **knobs)


def test_finished_rows_are_replaced_at_once(model64):
    """At most `max_rows` rows per forward; when one finishes the next request joins in the next forward, so the
    stream takes fewer forwards than decoding it in fixed batches of the same size."""
    from refusion_hf.generation.batch_scheduler import decode_batch
    from refusion_hf.generation.ragged_kv_cache import forward_queries
    from refusion_hf.generation.sequence_state import DecodingSettings

    torch.manual_seed(3)
    prompts = [torch.randint(4, 64, (int(n),)) for n in torch.randint(2, 12, (9,))]
    settings_ = DecodingSettings(
        max_new_tokens=24, slot_size=2, block_size=8, slot_threshold=0.5, token_threshold=0.3, mask_token_id=3,
        eos_token_ids=(EOS,),
    )  # fmt: skip
    rows_per_forward, finished = [], []

    def forward(model, kv, queries, pad):
        rows_per_forward.append(len(queries))
        return forward_queries(model, kv, queries, pad)

    stream = decode_batch(
        model64, prompts, settings_, 0, forward=forward, max_rows=3, on_finish=lambda i, s: finished.append(i)
    )
    assert max(rows_per_forward) == 3 and sorted(finished) == list(range(9))
    fixed = sum(decode_batch(model64, prompts[i : i + 3], settings_, 0).num_forward_passes for i in range(0, 9, 3))
    assert stream.num_forward_passes < fixed
    for index, prompt in enumerate(prompts):  # ... and each answer is the one it has alone
        alone = decode_batch(model64, [prompt], settings_, 0)
        n = alone.answer_lengths[0]
        assert stream.answer_lengths[index] == n
        assert torch.equal(stream.tokens[index, :n], alone.tokens[0, :n])


def test_withdrawn_prompts_leave_before_the_next_forward(model64):
    """`withdrawing`: a prompt withdrawn while it decodes leaves the batch before the next forward (one row fewer
    from then on) and one withdrawn while it waits is never decoded; their answers are empty, the others' are the
    ones they have alone, and an empty withdrawal set changes nothing (same forwards)."""
    from refusion_hf.generation.batch_scheduler import decode_batch, withdrawing
    from refusion_hf.generation.ragged_kv_cache import forward_queries
    from refusion_hf.generation.sequence_state import DecodingSettings

    torch.manual_seed(5)
    prompts = [torch.randint(4, 64, (n,)) for n in (5, 7, 3, 6)]
    settings_ = DecodingSettings(
        max_new_tokens=16, slot_size=2, block_size=8, slot_threshold=0.5, token_threshold=0.3, mask_token_id=3,
        eos_token_ids=(EOS,),
    )  # fmt: skip
    plain = decode_batch(model64, prompts, settings_, 0, max_rows=2)
    with withdrawing(set()):
        assert decode_batch(model64, prompts, settings_, 0, max_rows=2).num_forward_passes == plain.num_forward_passes
    withdrawn, rows_per_forward = {3}, []

    def forward(model, kv, queries, pad):
        rows_per_forward.append(len(queries))
        if len(rows_per_forward) == 3:
            withdrawn.add(1)  # while prompts 0 and 1 decode: 1 leaves before the 4th forward
        return forward_queries(model, kv, queries, pad)

    with withdrawing(withdrawn):
        result = decode_batch(model64, prompts, settings_, 0, forward=forward, max_rows=2)
    assert rows_per_forward[:4] == [2, 2, 2, 1], rows_per_forward
    assert result.answer_lengths[1] == result.answer_lengths[3] == 0 and result.forward_passes_per_row[3] == 0
    for index in (0, 2):
        alone = decode_batch(model64, [prompts[index]], settings_, 0)
        n = alone.answer_lengths[0]
        assert n > 0 and result.answer_lengths[index] == n
        assert torch.equal(result.tokens[index, :n], alone.tokens[0, :n])
    assert result.num_forward_passes < plain.num_forward_passes


def test_following_reports_each_prompts_final_tokens_as_they_are_decided(model64):
    """`following`: with continuous batching, each prompt's reported pieces join to its answer, and they come over
    several forwards (not at the end): what a server streams."""
    from refusion_hf.generation.batch_scheduler import decode_batch, following
    from refusion_hf.generation.ragged_kv_cache import forward_queries
    from refusion_hf.generation.sequence_state import DecodingSettings

    torch.manual_seed(6)
    prompts = [torch.randint(4, 64, (n,)) for n in (5, 7, 3, 6)]
    settings_ = DecodingSettings(
        max_new_tokens=48, slot_size=2, block_size=8, slot_threshold=0.5, token_threshold=0.3, mask_token_id=3,
        eos_token_ids=(EOS,),
    )  # fmt: skip
    forwards, pieces = [], {index: [] for index in range(len(prompts))}

    def forward(model, kv, queries, pad):
        forwards.append(len(queries))
        return forward_queries(model, kv, queries, pad)

    with following(lambda index, tokens: pieces[index].append((len(forwards), tokens))):
        result = decode_batch(model64, prompts, settings_, 0, forward=forward, max_rows=2)
    for index in range(len(prompts)):
        n = result.answer_lengths[index]
        assert sum((tokens for _, tokens in pieces[index]), []) == result.tokens[index, :n].tolist()
    # the longer answers are reported over several forwards
    assert sum(len({at for at, _ in reported}) > 1 for reported in pieces.values()) >= 2, pieces


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stop_strings": ["x"], "tokenizer": object()}, "cannot apply `stop_strings`"),
        ({"max_time": 5.0}, "cannot apply `max_time`"),
        ({"record_timestamps": True}, "record_timestamps=True"),
        ({"persistent_manager": True}, "persistent_manager=True"),
        ({"continuous_batching_config": ContinuousBatchingConfig(max_batch_tokens=256)}, "max_batch_tokens"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"max_length": 12}, "pass `max_new_tokens`"),
        ({"decoding": "autoregressive", "do_sample": True}, r"would ignore \['do_sample'\]"),
        ({"attention_mask": torch.ones(2, 3)}, "takes no `attention_mask`"),  # the prompts are padded here
        ({"custom_generate": "folder"}, "takes no `custom_generate`"),
        ({"return_dict_in_generate": False}, "takes no `return_dict_in_generate`"),
        ({"generation_config": GenerationConfig(is_assistant=True)}, "drafts nothing for assisted decoding"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(model32, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model32.generate_batch([[5, 6, 7], [8, 9]], max_new_tokens=4, **kwargs)


def test_bad_inputs_are_refused(model32):
    for inputs in ([], [[]], "text", [["a", "b"]], [[2**64]], [5, 6]):
        with pytest.raises(ValueError, match="inputs"):
            model32.generate_batch(inputs, max_new_tokens=4)
    # Token ids are checked as generate() checks them: integers, inside the vocabulary.
    for inputs, dtype in (([[5, 6], [5.0, 6.0]], "torch.float32"), ([[True, False]], "torch.bool")):
        with pytest.raises(
            ValueError, match=rf"`inputs\[{len(inputs) - 1}\]` must hold integer token ids, got dtype {dtype}"
        ):
            model32.generate_batch(inputs, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"must hold integer token ids, got dtype torch.float64"):
        model32.generate_batch([torch.tensor([5.0, 6.0], dtype=torch.float64)], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"`input_ids` holds ids outside the vocabulary \(0 .. 63\)"):
        model32.generate_batch([[5, 64]], max_new_tokens=4)


def test_autoregressive_decoding_is_transformers_own_generate_batch(model32):
    small = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=32)  # transformers' paged cache, kept small
    results = model32.generate_batch(
        [[5, 6, 7], [8, 9]], decoding="autoregressive", max_new_tokens=4, continuous_batching_config=small
    )
    for index, prompt in enumerate([[5, 6, 7], [8, 9]]):
        expected = model32.generate(torch.tensor([prompt]), decoding="autoregressive", max_new_tokens=4)
        assert results[f"req_{index}"].generated_tokens == expected[0, len(prompt) :].tolist()
