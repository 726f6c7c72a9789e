"""Streamers get the prompt, then answer tokens as soon as the left-to-right prefix is final; drafts on the
side when the streamer takes them."""

import torch
from transformers import AutoTokenizer, TextDiffusionStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

PROMPT = torch.tensor([[32, 24, 53, 31, 52, 63, 5, 38]])
KNOBS = dict(max_new_tokens=24, slot_size=4, block_size=8, slot_threshold=0.6, token_threshold=0.3)


class Recorder(BaseStreamer):
    def __init__(self, with_drafts=True):
        self.puts, self.drafts, self.ended = [], [], False
        if not with_drafts:
            self.put_draft = None

    def put(self, value):
        self.puts.append(value.tolist())

    def put_draft(self, value):
        self.drafts.append(value.tolist())

    def end(self):
        self.ended = True


def answer(sequence, prompt_length):
    tokens = sequence[prompt_length:].tolist()
    return tokens[: tokens.index(1) + 1] if 1 in tokens else tokens


def test_put_receives_prompt_then_final_prefix_pieces(model64):
    recorder = Recorder()
    out = model64.generate(PROMPT, streamer=recorder, return_dict_in_generate=True, **KNOBS)
    assert recorder.ended
    assert recorder.puts[0] == PROMPT.tolist()
    streamed = [token for piece in recorder.puts[1:] for token in piece]
    assert streamed == answer(out.sequences[0], 8)
    assert len(recorder.puts) > 2, "the answer arrives in several pieces, not all at the end"
    # A piece is sent as soon as it is final: the pieces arrive in commit-step order.
    steps = out.commit_step[0].tolist()
    offset, last_step = 0, -1
    for piece in recorder.puts[1:]:
        step = max(steps[offset : offset + len(piece)])
        assert step >= last_step
        offset, last_step = offset + len(piece), step


def test_drafts_are_sent_when_the_streamer_takes_them(model64):
    recorder = Recorder()
    model64.generate(PROMPT, streamer=recorder, **KNOBS)
    assert recorder.drafts, "put_draft received the current drafts"
    assert all(len(d) <= 24 for d in recorder.drafts)
    assert any(3 not in d[:4] for d in recorder.drafts), "drafts carry proposed tokens, not only masks"
    no_drafts = Recorder(with_drafts=False)
    model64.generate(PROMPT, streamer=no_drafts, **KNOBS)
    assert no_drafts.puts == [p for p in recorder.puts]


def test_text_streamers_print_the_answer(model64, fixture_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(fixture_path)
    out = model64.generate(PROMPT, streamer=TextStreamer(tokenizer, skip_prompt=True), **KNOBS)
    printed = capsys.readouterr().out
    assert printed.strip() == tokenizer.decode(answer(out[0], 8)).strip()
    model64.generate(PROMPT, streamer=TextDiffusionStreamer(tokenizer, skip_prompt=True), **KNOBS)
    printed = capsys.readouterr().out
    assert tokenizer.decode(answer(out[0], 8)).strip().split()[-1] in printed
