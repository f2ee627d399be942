"""What a config field declares about itself, in one place: next to its type and default.

    layernorm_epsilon: float = knob(1e-5, mcore=TC, range="> 0")
    adam_beta1: float = knob(0.9, mcore=OPT, resume=REPLACED, range="[0, 1)")

- `mcore`: the Megatron-Core config attribute the field feeds (`Feed`: `TC` = `TransformerConfig.<same name>`,
  `TC.attr("other")` when Megatron-Core names it otherwise; a tuple when it feeds several). Whoever builds that
  config passes every such field by `mcore_kwargs(section, feed)`; derived values (defaults from the layout,
  function objects, ...) are computed by the builder, one named function each.
- `resume`: its class in the resume contract and what happens (`Resume`; `MATCH`, `CHANGE`, `UNUSED`). A section
  may give one rule to all its fields (`RESUME = NEXT_STEP` in the class body); `pretrain/checkpoint/contract.py`
  reads these, docs/checkpoints.md's table is checked against them.
- `range`: the values that mean something: `"> 0"`, `">= 1"`, `"[0, 1)"`, `"(0, 1]"`, `"[1, 100]"`, or `"finite"`
  (any finite number). A float is always refused when not finite (nan, inf). `why` adds the reason to the message,
  `fix` replaces the generated fix (`{key}` is the dotted key). `outside_ranges(tree)` lists the values outside;
  `validate` words them (`pretrain/rules/bounds.py`).

Sits below `pretrain` (the config tree's sections in `pretrain/config.py` import it) and `model_providers/core`
(the builder reads the declarations of the instance it gets); no torch import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

MATCH, CHANGE, UNUSED = "must match", "changes and takes effect", "not used on resume"


@dataclass(frozen=True)
class Resume:
    """A field's rule when a run resumes: its class (`MATCH`, `CHANGE`, `UNUSED`) and what happens."""

    cls: str
    how: str


# The rules most fields share (a field or section with another says its own).
IDENTITY = Resume(MATCH, "the model's identity: a resumed run trains the same model")
NEXT_STEP = Resume(CHANGE, "from the resumed step")
REPLACED = Resume(CHANGE, "this config's value replaces the checkpoint's from the resumed step")
RESHARD = Resume(CHANGE, "the checkpoint is resharded to the new layout (RNG states restored only for the same "
                         "layout)")


@dataclass(frozen=True)
class Feed:
    """A Megatron-Core config a field feeds: the class, the attribute (None: the field's name) and the case the
    builder passes it in (`when`: "" always; e.g. "moe" only for a model with experts)."""

    config: str
    attr: str | None = None
    when: str = ""

    def named(self, attr: str) -> Feed:
        """The same config, under another attribute name."""
        return dataclasses.replace(self, attr=attr)


TC = Feed("TransformerConfig")
MOE = Feed("TransformerConfig", when="moe")  # only for a model with experts
FP8 = Feed("TransformerConfig", when="fp8")  # only with an FP8 recipe
MTP = Feed("TransformerConfig", when="mtp")  # only with Multi-Token Prediction
MLA = Feed("MLATransformerConfig")  # only with Multi-Latent Attention
YARN = Feed("TransformerConfig", when="yarn")  # set on the built config (Megatron-Core reads yarn_* attributes)
QK_CLIP = Feed("TransformerConfig", when="qk_clip")  # only with optimizer.muon.qk_clip
GPT = Feed("GPTModel")  # GPTModel's own arguments
HYBRID = Feed("TransformerConfig", when="hybrid")  # only for a hybrid Mamba model (model.hybrid_layer_pattern)
HYBRID_MODEL = Feed("MambaModel")  # MambaModel's own arguments (0.19's names; mamba_builder renames for 0.16.1-0.18)
MIXER = Feed("MambaMixer")  # the Mamba-2 mixer's constructor arguments (its layer spec's params)
OPT = Feed("OptimizerConfig")
DDP = Feed("DistributedDataParallelConfig")
DATASET = Feed("GPTDatasetConfig")

_INTERVAL = re.compile(r"^([\[(])\s*(\S+?)\s*,\s*(\S+?)\s*([\])])$")
_SIDE = re.compile(r"^(>=|>)\s*(\S+)$")


@dataclass(frozen=True)
class Range:
    """The numbers a field accepts: low..high, each end open or closed (None: unbounded); floats finite."""

    text: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    @staticmethod
    def parse(text: str) -> Range:
        side, interval = _SIDE.match(text.strip()), _INTERVAL.match(text.strip())
        if text.strip() == "finite":
            return Range("finite")
        if side:
            return Range(text, float(side.group(2)), None, side.group(1) == ">")
        if interval:
            lo, hi = float(interval.group(2)), float(interval.group(3))
            if not lo < hi:
                raise ValueError(f"range {text!r}: the low end must be below the high end")
            return Range(text, lo, hi, interval.group(1) == "(", interval.group(4) == ")")
        raise ValueError(f"range {text!r}: write '> 0', '>= 1', '[0, 1)', '[1, 100]' or 'finite'")

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def words(self, integer: bool) -> str:
        """What the value must be: 'at least 1', 'a finite number above 0', 'in [0, 1)'."""
        lo = _num(self.low)
        if self.low is None:
            return "a finite number"
        if self.high is not None:
            return f"in {self.text.strip()}"
        if integer:
            return f"above {lo}" if self.low_open else f"at least {lo}"
        return f"a finite number above {lo}" if self.low_open else f"a finite number, {lo} or more"

    def target(self, integer: bool) -> str:
        """What to set instead: 'a positive integer', 'a finite number above 0', 'a value in [0, 1)'."""
        if integer and self.high is None and self.low == 1 and not self.low_open:
            return "a positive integer"
        if integer and self.high is None:
            return f"an integer {self.words(True)}"
        return f"a value {self.words(integer)}" if self.high is not None else self.words(integer)


FINITE = Range.parse("finite")  # a float field that declares no range


def _num(x: float | None) -> str:
    return "" if x is None else str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Knob:
    """What `knob()` records in a dataclass field's metadata."""

    mcore: tuple[Feed, ...] = ()
    resume: Resume | None = None
    range: Range | None = None
    why: str | None = None
    fix: str | None = None


def knob(default: Any = dataclasses.MISSING, *, mcore: Feed | tuple[Feed, ...] = (), resume: Resume | None = None,
         range: str | None = None, why: str | None = None, fix: str | None = None,  # noqa: A002 - the knob's word
         default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its facts (see the module docstring)."""
    feeds = mcore if isinstance(mcore, tuple) else (mcore,)
    meta = Knob(feeds, resume, Range.parse(range) if range is not None else None, why, fix)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"knob": meta})
    return dataclasses.field(default=default, metadata={"knob": meta})


def knob_of(field: dataclasses.Field) -> Knob:
    """A field's declaration (an empty `Knob` for a plain field)."""
    return field.metadata.get("knob", Knob())


def resume_of(cls: type, field: dataclasses.Field) -> Resume | None:
    """A field's resume rule: its own, else its section's (`RESUME` in the class body)."""
    return knob_of(field).resume or getattr(cls, "RESUME", None)


def leaves(cls: type, prefix: str = "") -> list[tuple[str, type, dataclasses.Field]]:
    """(dotted key, its section class, field) of every leaf of a dataclass tree, in declaration order."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, type, dataclasses.Field]] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", cls, f))
    return out


def number_types(hint: Any) -> set[type]:
    """`int` and/or `float` where a field's annotation holds a number (`int`, `float | None`, `int | list[int]`);
    empty for other types (a list of numbers included)."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return {a for a in args if a in (int, float)}


@dataclass(frozen=True)
class OutOfRange:
    """A numeric leaf whose value is outside its declared range (`outside_ranges`)."""

    key: str  # dotted, e.g. "optimizer.lr"
    value: Any
    rule: Range  # the declared range, or "finite" for a float that declares none
    knob: Knob
    integer: bool
    nullable: bool
    default: Any


@functools.lru_cache(maxsize=4)
def numeric_fields(tree: type) -> tuple[tuple[str, Knob, bool, bool], ...]:
    """(dotted key, declaration, integer?, may be null?) of every int or float leaf of the config tree `tree`."""
    out = []
    for key, section, f in leaves(tree):
        hint = typing.get_type_hints(section)[f.name]
        numbers = number_types(hint)
        if numbers:
            out.append((key, knob_of(f), float not in numbers, type(None) in typing.get_args(hint)))
    return tuple(out)


def _at(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = getattr(tree, part)
    return tree


def outside_ranges(tree: Any) -> list[OutOfRange]:
    """Every numeric leaf of the config tree `tree` (an instance) outside its declared range, in declaration order
    (a float without a range must be finite; null, booleans and lists are not checked here)."""
    out = []
    for key, decl, integer, nullable in numeric_fields(type(tree)):
        value = _at(tree, key)
        if value is None or isinstance(value, (bool, list)):  # a list (per-layer choices) has its own rule
            continue
        rule = decl.range or (None if integer else FINITE)
        if rule is not None and not rule.holds(value):
            out.append(OutOfRange(key, value, rule, decl, integer, nullable, _at(type(tree)(), key)))
    return out


def mcore_kwargs(section: Any, feed: Feed) -> dict[str, Any]:
    """{Megatron-Core attribute: value} of every field of `section` (a dataclass instance) declared as feeding
    `feed`'s config in `feed`'s case."""
    out = {}
    for f in dataclasses.fields(section):
        for target in knob_of(f).mcore:
            if target.config == feed.config and target.when == feed.when:
                value = getattr(section, f.name)
                out[target.attr or f.name] = list(value) if isinstance(value, list) else value  # a copy
    return out
