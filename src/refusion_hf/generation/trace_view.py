"""Pictures of a ReFusion decode: which step committed which token.

Input is the trace `generate(..., return_dict_in_generate=True)` returns for one row: `commit_step` (for each
generated position, the planning step that committed it, -1 after the answer), `chosen_slots` (for each
step, the start offsets of the slots its plan chose) and `revision_counts` (for each position, how many times a
revision remasked it: `remask_threshold`).

* `ansi_by_step` colours the answer's tokens by commit step for a terminal, revised tokens underlined;
* `order_summary` says how many slots each step committed, how many were written before a slot to their left
  (the paper's parallel, out-of-order slots, where one slot per block shows neither) and how many tokens a
  revision replaced;
* `write_trace` draws the canvas once per step (rows = steps, columns = positions), like the paper's
  visualisation: tokens written in that step highlighted, earlier ones grey, masks empty, chosen slots boxed, a
  revised token's final writing outlined in red. `.html` needs nothing; `.png` uses matplotlib.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

_ANSI_COLOURS = [31, 32, 33, 34, 35, 36, 91, 92, 93, 94, 95, 96]
_UNDERLINE = 4
_REVISED_EDGE = "#c62828"


@dataclass
class DecodeTrace:
    tokens: list[str]  # text of each generated position of the answer
    commit_step: list[int]  # same length; step that committed each position
    chosen_slots: list[list[int]]  # per step, start offsets of the chosen slots
    slot_size: int
    revisions: list[int] = field(default_factory=list)  # per position, times a revision remasked it (empty: none)

    @classmethod
    def from_output(cls, output, row: int, prompt_length: int, tokenizer, slot_size: int) -> DecodeTrace:
        steps = output.commit_step[row].tolist()
        length = sum(step >= 0 for step in steps)
        ids = output.sequences[row, prompt_length : prompt_length + length].tolist()
        # Each token's text as it appears in the decoded answer (keeps the tokenizer's spacing).
        texts = [tokenizer.decode(ids[:end]) for end in range(length + 1)]
        return cls(
            tokens=[
                texts[i + 1][len(texts[i]) :] if texts[i + 1].startswith(texts[i]) else tokenizer.decode([ids[i]])
                for i in range(length)
            ],
            commit_step=steps[:length],
            chosen_slots=output.chosen_slots[row],
            slot_size=slot_size,
            revisions=output.revision_counts[row, :length].tolist(),
        )

    @property
    def num_steps(self) -> int:
        return len(self.chosen_slots)

    def revised(self, position: int) -> bool:
        return position < len(self.revisions) and self.revisions[position] > 0


def ansi_by_step(trace: DecodeTrace) -> str:
    """The answer with each token coloured by the step that committed it (underlined: a revision replaced it), and
    a legend."""
    pieces = []
    for position, (token, step) in enumerate(zip(trace.tokens, trace.commit_step)):
        style = f"{_UNDERLINE};" if trace.revised(position) else ""
        pieces.append(f"\033[{style}{_ANSI_COLOURS[step % len(_ANSI_COLOURS)]}m{token}\033[0m")
    legend = " ".join(f"\033[{_ANSI_COLOURS[s % len(_ANSI_COLOURS)]}mstep {s}\033[0m" for s in range(trace.num_steps))
    if any(map(trace.revised, range(len(trace.tokens)))):
        legend += f" \033[{_UNDERLINE}mrevised\033[0m"
    return "".join(pieces) + "\n" + legend


def slots_per_step(trace: DecodeTrace) -> list[int]:
    """For each step, the slots holding a token it committed (a token's slot is its position // slot size)."""
    slots: list[set[int]] = [set() for _ in range(trace.num_steps)]
    for position, step in enumerate(trace.commit_step):
        if 0 <= step < trace.num_steps:
            slots[step].add(position // trace.slot_size)
    return [len(step_slots) for step_slots in slots]


def slots_out_of_order(trace: DecodeTrace) -> int:
    """Slots whose tokens were all committed before the last token of some slot to their left was."""
    done: dict[int, int] = {}  # slot -> the step that committed its last token
    for position, step in enumerate(trace.commit_step):
        if step >= 0:
            slot = position // trace.slot_size
            done[slot] = max(done.get(slot, step), step)
    finished = [done[slot] for slot in sorted(done)]
    return sum(step < max(finished[:i], default=-1) for i, step in enumerate(finished))


def order_summary(trace: DecodeTrace) -> str:
    """One line: slots committed per step, steps that committed several, slots written out of order, tokens a
    revision replaced."""
    counts = [count for count in slots_per_step(trace) if count]
    several = sum(count > 1 for count in counts)
    revised = sum(map(trace.revised, range(len(trace.tokens))))
    return (
        f"slots committed per step: {' '.join(map(str, counts))} (slot size {trace.slot_size}); {several} of "
        f"{len(counts)} steps committed several slots at once; {slots_out_of_order(trace)} slots were written "
        f"before a slot to their left; {revised} tokens were revised"
    )


def write_trace(trace: DecodeTrace, path: str | Path) -> Path:
    path = Path(path)
    if path.suffix == ".html":
        path.write_text(_trace_html(trace))
    elif path.suffix == ".png":
        _trace_png(trace, path)
    else:
        raise ValueError(f"--trace-out must end in .html or .png, got {path.name!r}")
    return path


def _cell_state(trace: DecodeTrace, step: int, position: int) -> str:
    committed = trace.commit_step[position]
    if committed == step:
        return "new"
    if 0 <= committed < step:
        return "old"
    return "mask"


def _trace_html(trace: DecodeTrace) -> str:
    colours = {"new": "#ffd54f", "old": "#e0e0e0", "mask": "#ffffff"}
    rows = []
    for step in range(trace.num_steps):
        chosen = {start + i for start in trace.chosen_slots[step] for i in range(trace.slot_size)}
        cells = []
        for position, token in enumerate(trace.tokens):
            state = _cell_state(trace, step, position)
            text = html.escape(token) if state != "mask" else "&#9633;"
            border = "2px solid #1565c0" if position in chosen else "1px solid #bdbdbd"
            if state == "new" and trace.revised(position):
                border = f"2px solid {_REVISED_EDGE}"
            cells.append(f'<td style="background:{colours[state]};border:{border}">{text}</td>')
        rows.append(f"<tr><th>step {step}</th>{''.join(cells)}</tr>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>ReFusion decoding trace</title>"
        "<style>table{border-collapse:collapse;font-family:monospace;font-size:12px}"
        "td,th{padding:2px 4px;white-space:pre}</style></head><body>"
        "<p>Rows are decoding steps; yellow = written in that step, grey = written earlier, "
        "blue boxes = slots chosen by that step's plan, red = a token a revision replaced, written again.</p>"
        f"<table>{''.join(rows)}</table></body></html>\n"
    )


def _trace_png(trace: DecodeTrace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colours = {"new": "#ffd54f", "old": "#e0e0e0", "mask": "#ffffff"}
    width, height = len(trace.tokens), trace.num_steps
    figure, axes = plt.subplots(figsize=(max(4.0, 0.45 * width), max(1.5, 0.4 * height + 0.8)))
    for step in range(height):
        y = height - 1 - step
        for position, token in enumerate(trace.tokens):
            state = _cell_state(trace, step, position)
            revised = state == "new" and trace.revised(position)
            edge, line = (_REVISED_EDGE, 1.5) if revised else ("#bdbdbd", 1.0)
            axes.add_patch(Rectangle((position, y), 1, 1, facecolor=colours[state], edgecolor=edge, linewidth=line))
            if state != "mask":
                axes.text(position + 0.5, y + 0.5, token.strip()[:6], ha="center", va="center", fontsize=6)
        for start in trace.chosen_slots[step]:
            span = min(trace.slot_size, width - start)
            if span > 0:
                axes.add_patch(Rectangle((start, y), span, 1, fill=False, edgecolor="#1565c0", linewidth=1.5))
    axes.set_xlim(0, width)
    axes.set_ylim(0, height)
    axes.set_yticks([height - 1 - s + 0.5 for s in range(height)], [f"step {s}" for s in range(height)])
    axes.set_xticks([])
    axes.set_title("ReFusion decoding: yellow = written in this step, boxes = chosen slots, red = revised", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
