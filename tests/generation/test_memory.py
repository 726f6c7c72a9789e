"""Memory follows the work done, not `max_new_tokens`: the canvas is allocated block by block as decoding reaches
it, so a request that ends at its EOS costs the same whatever `max_new_tokens` says (as in stock generate)."""

import resource
import sys

import pytest
import torch

from tests.generation.test_generate_api import EOS

# An answer of 13 tokens ending at EOS, over four blocks of 4: the canvas grows as the blocks are entered.
PROMPT = [5, 16, 27, 4, 59, 49, 26, 63, 15, 32]
SHORT = [61, 61, 33, 51, 20, 31, 13, 32, 23, 6, 13, 40]  # answers EOS at once
KNOBS = dict(slot_size=4, block_size=4, slot_threshold=0.6, token_threshold=0.3)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def peak_growth_kib(call) -> int:
    """Resident memory `call()` adds at its peak, measured: the kernel's high-water mark (VmHWM) is reset to the
    current resident size before the call and read after it. The address space is capped 3 GiB above its current
    size meanwhile, so a regression (a canvas of 10**9 positions is 16 GB) fails here instead of filling the machine."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # reset VmHWM (Linux >= 4.0)
    except OSError:
        pytest.skip("the kernel's peak resident memory cannot be reset here (/proc/self/clear_refs)")
    before = _status_kib("VmRSS")
    limits = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_status_kib("VmSize") * 1024 + 3 * 2**30, limits[1]))
    try:
        call()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)
    return _status_kib("VmHWM") - before


def measured(call, max_new_tokens: int) -> tuple[list[int], int]:
    """`call(max_new_tokens)`'s answer and the resident memory it added at its peak (KiB)."""
    answers = []
    growth = peak_growth_kib(lambda: answers.append(call(max_new_tokens)))
    return answers[0], growth


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident memory from /proc")
@pytest.mark.filterwarnings("ignore:The longest prompt")  # 10**9 is beyond the fixture's 512 positions: a warning
def test_a_request_that_ends_at_eos_costs_the_same_whatever_max_new_tokens_says(model32):
    ids = torch.tensor([PROMPT])
    calls = {
        "generate": lambda n: model32.generate(ids, max_new_tokens=n, **KNOBS)[0, len(PROMPT) :].tolist(),
        "generate_batch": lambda n: (  # the same decoder: a short answer (EOS at once) keeps the test cheap
            model32.generate_batch([SHORT], max_new_tokens=n, **KNOBS)["req_0"].generated_tokens
        ),
    }
    for name, call in calls.items():
        # 64 first: 10**9 runs only once the answer is known to end at its EOS (else it would decode for ever).
        answer, growth = measured(call, 64)
        assert answer[-1] == EOS and len(answer) < 64, f"{name}: the answer ends at its EOS"
        huge_answer, huge_growth = measured(call, 10**9)
        assert huge_answer == answer, f"{name}: max_new_tokens beyond the answer changes nothing"
        # 10**9 positions would be 8 GB per int64 tensor; what is left is allocator noise.
        assert huge_growth < growth + 16 * 1024, f"{name}: peak growth {huge_growth} KiB, {growth} KiB at 64"


def test_max_new_tokens_beyond_what_torch_can_index_is_refused(model64):
    """Positions are int64: the longest prompt plus max_new_tokens rounded up to slot_size must stay below 2**63.
    Up to that bound any max_new_tokens decodes (and costs what the answer costs)."""
    ids = torch.tensor([SHORT])
    knobs = dict(slot_size=1, slot_threshold=0.0, token_threshold=1.01)
    with pytest.warns(UserWarning, match="exceeds the model's predefined maximum length"):
        out = model64.generate(ids, max_new_tokens=2**63 - 1 - 12, **knobs)
    assert out[0, 12:].tolist() == [EOS]
    for n in (2**63 - 12, 2**63, 10**30):
        with pytest.raises(ValueError, match=rf"`max_new_tokens` \({n}\) is beyond what torch can index"):
            model64.generate(ids, max_new_tokens=n, **knobs)
        with pytest.raises(ValueError, match=rf"`max_new_tokens` \({n}\) is beyond what torch can index"):
            model64.generate_batch(ids.tolist(), max_new_tokens=n, **knobs)


def test_min_new_tokens_beyond_int64_still_holds_off_the_eos(model64):
    """A min_new_tokens past the canvas blocks the EOS everywhere, however large (2**63 used to wrap in the
    comparison with int64 offsets and let the EOS through at once)."""
    ids = torch.tensor([SHORT])
    knobs = dict(max_new_tokens=4, slot_size=1, slot_threshold=0.0, token_threshold=1.01)
    held = model64.generate(ids, min_new_tokens=4, **knobs)
    assert EOS not in held[0, 12:].tolist() and held.shape == (1, 16)
    for n in (10**9, 2**63, 10**30):
        assert torch.equal(model64.generate(ids, min_new_tokens=n, **knobs), held)
