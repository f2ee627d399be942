"""The pipeline placements `plan --search` tries when the decoder layers do not divide the virtual stages: uneven first
/ last stages, the embedding and loss counted in the split (`parallel.account_for_*_in_pipeline_split`, as
Megatron-Bridge places Llama-3.1-405B and Qwen3-235B), and a layout string (`parallel.pipeline_layout`, as it places
DeepSeek-V3: every virtual stage as full as the most loaded one, the last lighter, with the MTP layers and the loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One way to place the layers: the config keys it sets (None / False: not used)."""

    first: int | None = None  # parallel.num_layers_in_first_pipeline_stage
    last: int | None = None  # parallel.num_layers_in_last_pipeline_stage
    layout: str | None = None  # parallel.pipeline_layout
    embedding_and_loss: bool = False  # parallel.account_for_{embedding,loss}_in_pipeline_split

    def overrides(self) -> list[str]:
        """The `section.key=value` overrides of this placement (nothing for the even split)."""
        out = []
        if self.first is not None:
            out += [f"parallel.num_layers_in_first_pipeline_stage={self.first}",
                    f"parallel.num_layers_in_last_pipeline_stage={self.last}"]
        if self.layout is not None:
            out.append(f"parallel.pipeline_layout={self.layout}")
        if self.embedding_and_loss:
            out += ["parallel.account_for_embedding_in_pipeline_split=true",
                    "parallel.account_for_loss_in_pipeline_split=true"]
        return out


def layout_string(num_layers: int, stages: int, mtp: bool) -> str | None:
    """Megatron-Core's layout string as Megatron-Bridge writes them: ceil(L / stages) decoder layers on every virtual
    stage but the last and the first, which give up the shortfall (the last first: it holds the loss and the MTP
    layers; then the first, which holds the embedding). 61 layers with MTP over 16 stages: `Et*4|(t*4|)*14tmL`, over
    32: `Et|(tt|)*30mL`. None when that leaves the middle stages unequal or a stage empty (but the last)."""
    per = math.ceil(num_layers / stages)
    excess = per * stages - num_layers
    if stages < 3 or excess > 2 * per - 1:
        return None
    last = per - min(excess, per)
    first = per - (excess - (per - last))

    def run(c: int) -> str:
        return "t" * c if c <= 2 else f"t*{c}"

    return f"E{run(first)}|({run(per)}|)*{stages - 2}{run(last)}{'m' if mtp else ''}L"


def placements(num_layers: int, pp: int, vp: int, mtp: bool, uneven: tuple[int | None, int | None] | None
               ) -> list[Placement]:
    """The placements of `num_layers` on pp × vp virtual stages: the even split where it divides; else the uneven
    first / last stages `uneven` (`search.uneven_split`), the embedding and loss counted as layers where L + 2 divides,
    and, where neither places them, the layout string (a search of DeepSeek-V3 on 256 GPUs stays near its old size)."""
    stages = pp * vp
    if num_layers % stages == 0:
        return [Placement()]
    if pp < 2:
        return []
    out = [Placement(first=uneven[0], last=uneven[1])] if uneven else []
    if (num_layers + 2) % stages == 0:
        out.append(Placement(embedding_and_loss=True))
    layout = None if out else layout_string(num_layers, stages, mtp)  # where nothing simpler places the layers
    if layout is not None:
        out.append(Placement(layout=layout))
    return out
