"""One owner for the decoding state (docs/design.md §3, "Who writes the state"): the stages decide typed transitions
(src/refusion_hf/generation/transitions.py) and `SequenceState.apply` alone executes them.

Two checks, each from outside the code it guards: a scan of the source of every generation module but
sequence_state.py for writes into a state field (assignment, augmented assignment, item assignment, an in-place
method, or a call of one of the state's private writers), and a scripted decode (planning ahead, infill, an EOS,
a revision, a stopping criterion) during which every attribute write on a `SequenceState` or `ChosenSlots` is
recorded with the file that made it. The scan's own rule is shown to catch the writes the stages made before
(`test_the_scan_catches_a_stage_writing_the_state`).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import torch
from transformers import EosTokenCriteria, StoppingCriteriaList

from refusion_hf.generation import sequence_state
from refusion_hf.generation.batch_scheduler import decode_batch
from refusion_hf.generation.draft_policy import DraftPolicy
from refusion_hf.generation.prefix_stopping import PrefixStopping
from refusion_hf.generation.sequence_state import ChosenSlots, SequenceState
from tests.generation.scripted_logits import EOS, MASK, PAD, UNSURE, Belief, ScriptedForward

GENERATION = Path(sequence_state.__file__).parent
OWNER = Path(sequence_state.__file__).name
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "add", "discard", "setdefault"}


def state_fields() -> set[str]:
    """The attributes of a live state and of its chosen slots."""
    settings = sequence_state.DecodingSettings(
        max_new_tokens=8, slot_size=2, block_size=4, slot_threshold=0.5, token_threshold=0.5, mask_token_id=MASK,
        eos_token_ids=(EOS,), remask_threshold=0.5,
    )  # fmt: skip
    state = SequenceState(torch.tensor([1, 2]), settings, DraftPolicy.greedy([MASK], "cpu"))
    return set(vars(state)) | {field.name for field in dataclasses.fields(ChosenSlots)}


def private_writers() -> set[str]:
    return {name for name, value in vars(SequenceState).items() if name.startswith("_") and callable(value)} - {
        "__init__"
    }


def _chain(node: ast.AST) -> list[ast.AST]:
    """The attribute / subscript / call chain under `node`, outermost first (`a.b.view(-1)[i]`: [i], the call, view,
    b, a)."""
    chain = []
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        chain.append(node)
        node = node.func if isinstance(node, ast.Call) else node.value
    return [*chain, node]


def _writes_field(target: ast.AST, fields: set[str]) -> str | None:
    """The state field a write to `target` changes, if any. `self.x` (and in place under it) is a class's own field."""
    chain = _chain(target)
    attributes = [node for node in chain if isinstance(node, ast.Attribute)]
    if not attributes:
        return None
    root = chain[-1]
    if isinstance(root, ast.Name) and root.id == "self" and len(attributes) == 1:
        return None
    return next((node.attr for node in attributes if node.attr in fields), None)


def state_writes(source: str, fields: set[str], writers: set[str]) -> list[str]:
    """`line: what` for every write into a state field in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            in_place = method in MUTATORS or (method.endswith("_") and not method.endswith("__"))
            if in_place and (field := _writes_field(node.func.value, fields)):
                found.append(f"{node.lineno}: {field}.{method}(...)")
            elif method in writers:
                found.append(f"{node.lineno}: {method}(...)")
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if field := _writes_field(element, fields):
                    found.append(f"{node.lineno}: {field} written")
    return found


def test_no_generation_module_but_the_owner_writes_the_state():
    fields, writers = state_fields(), private_writers()
    assert {"stage", "chosen", "pool", "tokens", "cached"} <= fields and "_commit" in writers  # the rule sees them
    modules = sorted(path for path in GENERATION.glob("*.py") if path.name != OWNER)
    assert len(modules) > 10
    offences = {path.name: writes for path in modules if (writes := state_writes(path.read_text(), fields, writers))}
    assert offences == {}, f"only sequence_state.py (`SequenceState.apply`) may write the decoding state: {offences}"


def test_the_scan_catches_a_stage_writing_the_state():
    """What the stages did before transitions: each line is one write the scan must report."""
    fields, writers = state_fields(), private_writers()
    before = [
        "chosen.tokens.view(-1)[feed.target_index] = proposals",  # InfillDraftStage.examine
        "state.stage = Stage.INFILL_VERIFY",
        "state.step += 1",
        "chosen.verified[ending] = chosen.cached[ending] = k",
        "chosen.confident, chosen.ends = decision",
        "state.trace_chosen.append([0])",
        "state.chosen.draft_probs.view(-1).index_fill_(0, index, 0.0)",
        "state._commit(slots, tokens)",
        "sequence._take_back(0, 2)",
    ]
    for line in before:
        assert state_writes(line, fields, writers), line
    reads = ["x = state.chosen.tokens.view(-1)[index]", "self.stage = stage", "parts.append(part)", "state.apply(t)"]
    for line in reads:
        assert state_writes(line, fields, writers) == [], line


class _Recorder:
    """Records every attribute write on the state classes with the file that made it (test-side only)."""

    def __init__(self):
        self.writers: dict[str, set[str]] = {}

    def patch(self, cls, monkeypatch):
        original = cls.__setattr__

        def recorded(instance, name, value):
            frame = sys._getframe(1)
            while frame.f_code.co_filename.startswith("<"):  # a dataclass's generated `__init__`: who called it
                frame = frame.f_back
            caller = Path(frame.f_code.co_filename).name
            self.writers.setdefault(caller, set()).add(f"{cls.__name__}.{name}")
            original(instance, name, value)

        monkeypatch.setattr(cls, "__setattr__", recorded)


class _StopAfter(EosTokenCriteria):
    """Fires once the answer holds `length` tokens (stock's call shape: [B, W + checked])."""

    def __init__(self, prompt_length: int, length: int):
        super().__init__(eos_token_id=EOS)
        self.at = prompt_length + length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.at, dtype=torch.bool)


def test_while_decoding_only_the_owner_writes_the_state(model64, monkeypatch):
    """Rows in every stage: plans riding along (verifications and re-scores), a rejected draft (infill), an EOS
    accepted in infill, a revision, a plan of its own and a stopping criterion's cut; every attribute write on the
    state comes from sequence_state.py."""
    recorder = _Recorder()
    recorder.patch(SequenceState, monkeypatch)
    recorder.patch(ChosenSlots, monkeypatch)
    settings = sequence_state.DecodingSettings(
        max_new_tokens=8, slot_size=2, block_size=4, slot_threshold=0.5, token_threshold=0.5, mask_token_id=MASK,
        eos_token_ids=(EOS,), plan_ahead=True, remask_threshold=0.5,
    )  # fmt: skip
    beliefs = [
        Belief([20, 21, 22, 23, 24, 25, 26, 27]),  # sure of everything: the plans ride along
        Belief([20, 21, 22, EOS, 24, 25, 26, 27], follow_p={2: UNSURE}),  # infill, then an EOS
        Belief([20, 21, 22, 23, 24, 25, 26, 27], guess={1: 40}, draft_p={1: UNSURE}),  # a revision's cut
        Belief([20, 21, 22, 23, 24, 25, 26, 27], draft_p={1: UNSURE, 2: UNSURE}),  # one slot chosen, then a plan
    ]
    prompts = [torch.tensor([10, 11, 12])] * len(beliefs)
    forward = ScriptedForward(beliefs, model64.config.vocab_size, settings.slot_size)
    stopping = PrefixStopping(StoppingCriteriaList([_StopAfter(3, 6)]), torch.tensor([[10, 11, 12]] * 4), PAD)
    seen_stages = set()
    result = decode_batch(
        model64, prompts, settings, PAD, stopping=stopping, forward=forward, on_finish=forward.finished,
        on_step=lambda sequences: seen_stages.update(sequence.stage for sequence in sequences),
    )  # fmt: skip
    every_stage = {"PLAN", "VERIFY", "INFILL_DRAFT", "INFILL_VERIFY", "REVISE", "DONE"}
    assert {stage.name for stage in seen_stages} == every_stage
    assert result.answer_lengths[0] == 6  # the criterion's cut
    assert set(recorder.writers) == {OWNER}, recorder.writers
    assert "SequenceState.stage" in recorder.writers[OWNER]
