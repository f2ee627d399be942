"""Megatron-Bridge's published pre-training table, planned row by row (`benchmarks/planner_vs_published.py --table`).

A row (one tab-separated line of `benchmarks/megatron_bridge_pretraining.tsv`'s format: container, model, variant,
preset, system, gpus, precision, gbs, mbs, seq, fsdp, tp, pp, cp, vp, ep, tokens_per_s_per_gpu, model_tflops_per_gpu)
is planned with our shipped config for its model (`benchmarks/published_models.yaml`: the one place that maps the
table's model names to configs), the row's layout, precision and batch, the settings every Megatron-Bridge recipe
shares, and what that run's recipe set (`benchmarks/published_recipes.yaml`). Where the row's PP × VP does not divide
the layers, the planner picks the placement itself (`planner.placements`: the candidates `plan --search` tries; the
fastest that passes validation and fits). A row whose model has no shipped config, or whose layout our validation
refuses, is refused with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import CONFIG_DIR, ConfigError, load_config
from pretrain.config_parse import yaml_error_line
from pretrain.observe.flops import flops_per_token
from pretrain.planner import published_errata as errata
from pretrain.planner.common import PlanError

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "benchmarks" / "megatron_bridge_pretraining.tsv"
MODELS = ROOT / "benchmarks" / "published_models.yaml"
RECIPES = ROOT / "benchmarks" / "published_recipes.yaml"
TOLERANCE = 0.15  # predicted tokens/s/GPU within ±15% of the published
FLOPS_TOLERANCE = 0.03
COLUMNS = ("container", "model", "variant", "preset", "system", "gpus", "precision", "gbs", "mbs", "seq", "fsdp", "tp",
           "pp", "cp", "vp", "ep", "tokens_per_s_per_gpu", "model_tflops_per_gpu")
# Held out of the calibration, chosen before any constant was set: every fifth data row (0-based index % 5 == 4).
HELD_OUT_EVERY = 5


def held_out(index: int) -> bool:
    """The row is kept out of the calibration (checked against, never fitted to)."""
    return index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


# A recipe's setting (Megatron-Bridge's WorkloadBaseConfig field) → our overrides.
def _recipe_overrides(settings: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    impl, scope = settings.get("cuda_graph_impl"), settings.get("cuda_graph_scope")
    if impl in ("local", "transformer_engine"):
        out["performance.cuda_graph_impl"] = impl
        scopes = [s for s in ([scope] if isinstance(scope, str) else scope or []) if s != "full_iteration"]
        out["performance.cuda_graph_scope"] = scopes or None
    if settings.get("recompute_modules"):
        out["model.recompute_granularity"] = "selective"
        out["model.recompute_modules"] = list(settings["recompute_modules"])
    if settings.get("recompute_num_layers"):
        out.update({"model.recompute_granularity": "full", "model.recompute_method": "block",
                    "model.recompute_num_layers": settings["recompute_num_layers"], "model.recompute_modules": None})
    # Megatron-Core reads the backend only under the flex dispatcher: a script that sets the backend and then the
    # alltoall dispatcher type (Megatron-Bridge v0.3.1's Qwen3-235B B200/B300/H100 configs) runs NCCL's all-to-all.
    if settings.get("moe_flex_dispatcher_backend") and settings.get("moe_token_dispatcher_type", "flex") == "flex":
        out["performance.moe_flex_dispatcher_backend"] = settings["moe_flex_dispatcher_backend"]
    if settings.get("moe_a2a_overlap"):
        out["performance.overlap_moe_expert_parallel_comm"] = True
    if settings.get("cpu_offloading_num_layers"):
        out["performance.cpu_offloading_num_layers"] = settings["cpu_offloading_num_layers"]
    for key in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        if settings.get(key):
            out[f"performance.{key}"] = settings[key]
    if settings.get("quant_recipe"):  # a file under the repository (benchmarks/quant_recipes/)
        out["performance.quant_recipe"] = str(ROOT / settings["quant_recipe"])
    out.update({_SWITCHES[k]: bool(v) for k, v in settings.items() if k in _SWITCHES})
    return out


# What a script turns off that every other recipe turns on (published_models.yaml `common`): recipe key → ours.
_SWITCHES = {"tp_comm_overlap": "parallel.tp_comm_overlap", "overlap_grad_reduce": "optimizer.overlap_grad_reduce",
             "overlap_param_gather": "optimizer.overlap_param_gather"}
RECIPE_KEYS = ("cuda_graph_impl", "cuda_graph_scope", "recompute_modules", "recompute_num_layers",
               "moe_flex_dispatcher_backend", "moe_token_dispatcher_type", "moe_a2a_overlap",
               "cpu_offloading_num_layers", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "quant_recipe",
               *_SWITCHES)


@dataclass(frozen=True)
class Row:
    """One data row of the table (0-based `index` among the data rows)."""

    index: int
    cells: dict[str, str]

    def num(self, key: str) -> int | None:
        cell = self.cells[key].strip()
        return None if cell in ("-", "") else int(cell)

    def figure(self, key: str) -> float:
        """A published figure; a footnote mark after it ("475[^note]") is not part of the number."""
        return float(self.cells[key].split("[")[0])

    @property
    def published(self) -> float:
        return self.figure("tokens_per_s_per_gpu")

    @property
    def published_flops_per_token(self) -> float:
        return self.figure("model_tflops_per_gpu") * 1e12 / self.published

    @property
    def name(self) -> str:
        c = self.cells
        variant = f" {c['variant']}" if c["variant"] != "-" else ""
        return f"{c['model']}{variant} {c['system'].upper()}x{c['gpus']} {c['precision'].upper()} ({c['container']})"


def read_table(path: Path = TABLE) -> list[Row]:
    """The data rows of a table in the published format ('#' lines are comments; the first other line is the
    header). ValueError naming the line on a missing column or a short row."""
    rows: list[Row] = []
    header: list[str] | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split("\t")
        if header is None:
            missing = [c for c in COLUMNS if c not in cells]
            if missing:
                raise ValueError(f"{path}:{number}: the header lacks {', '.join(missing)}")
            header = cells
            continue
        if len(cells) != len(header):
            raise ValueError(f"{path}:{number}: {len(cells)} cells, the header has {len(header)}")
        rows.append(Row(len(rows), dict(zip(header, cells))))
    return rows


@dataclass
class Harness:
    """The mapping (`published_models.yaml`), the recipes and the errata (`published_recipes.yaml`) the rows are
    planned with."""

    models: dict[str, Any]
    recipes: list[dict[str, Any]] = field(default_factory=list)
    errata: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, models: Path = MODELS, recipes: Path = RECIPES) -> Harness:
        """Read the model mapping and the recipes; a malformed file or an unknown recipe setting is a ValueError
        naming it."""
        data = _read_yaml(models)
        lacking = [k for k in ("models", "common", "precisions", "variants", "systems")
                   if not isinstance(data, dict) or not isinstance(data.get(k), dict)]
        if lacking:
            raise ValueError(f"{models}: needs the mappings {', '.join(lacking)} (as benchmarks/published_models.yaml)")
        listed = (_read_yaml(recipes) or {}) if recipes.exists() else {"recipes": []}
        if not isinstance(listed, dict):
            listed = {}
        recipe_list, fixes = listed.get("recipes"), listed.get("errata") or []
        if not isinstance(recipe_list, list) or not all(isinstance(r, dict) for r in recipe_list):
            raise ValueError(f"{recipes}: needs a `recipes:` list of entries")
        errata.check(recipes, fixes)
        for r in recipe_list:
            unknown = sorted(set(r.get("settings") or {}) - set(RECIPE_KEYS))
            if unknown:
                raise ValueError(f"{recipes}: recipe {r.get('container')} {r.get('model')} {r.get('system')} sets "
                                 f"{', '.join(unknown)}, not one of the recipe keys ({', '.join(RECIPE_KEYS)})")
        return cls(data, recipe_list, fixes)

    def config_name(self, row: Row) -> str | None:
        """Our config for the row's model (the mapping, else the row's preset column); None when none is named."""
        entry = self.models["models"].get(row.cells["model"])
        name = entry["config"] if entry else row.cells["preset"]
        return None if name in ("-", "", None) else name

    def recipe(self, row: Row) -> dict[str, Any] | None:
        c = row.cells
        key = {"container": c["container"], "model": c["model"], "system": c["system"], "precision": c["precision"],
               "tp": row.num("tp"), "pp": row.num("pp"), "cp": row.num("cp"), "vp": row.num("vp"),
               "ep": row.num("ep"), "mbs": row.num("mbs")}
        return next((r for r in self.recipes if all(r.get(k) == v for k, v in key.items())), None)

    def erratum(self, row: Row) -> dict[str, Any] | None:
        """The erratum whose container, model, system, precision and `table` cells are the row's, if any."""
        return next((e for e in self.errata if errata.matches(e, row.cells)), None)

    def overrides(self, row: Row) -> dict[str, Any]:
        """The row as config overrides (later entries win): common settings, precision, variant, the recipe's
        settings, the layout and batch."""
        c, m = row.cells, self.models
        tp, pp, cp, ep = row.num("tp"), row.num("pp"), row.num("cp"), row.num("ep")
        vp, fsdp = row.num("vp"), row.num("fsdp") or 0
        out: dict[str, Any] = {"data.mock": True}
        common = m["common"]
        for key in ("all", *(["fp8_param_gather"] if c["precision"] in ("fp8", "mxfp8") else []),
                    *(["tp_comm_overlap"] if tp > 1 and c["precision"] != "nvfp4" else [])):
            out.update(_pairs(common[key]))
        if c["precision"] not in m["precisions"]:
            raise PlanError(f"precision {c['precision']!r} is not one of {', '.join(m['precisions'])}")
        out.update(_pairs((m["models"].get(c["model"]) or {}).get("overrides", [])))
        out.update(_pairs(m["precisions"][c["precision"]]))
        out.update(_pairs(m.get("system_precisions", {}).get(c["system"], {}).get(c["precision"], [])))
        if c["variant"] not in m["variants"]:
            raise PlanError(f"variant {c['variant']!r} is not one of {', '.join(m['variants'])}")
        out.update(_pairs(m["variants"][c["variant"]]))
        recipe = self.recipe(row)
        if recipe:
            out.update(_recipe_overrides(recipe["settings"]))
        out.update({"parallel.tensor": tp, "parallel.pipeline": pp, "parallel.context": cp,
                    "parallel.virtual_pipeline": vp if vp and vp > 1 else None, "parallel.expert": ep,
                    "parallel.sequence_parallel": tp > 1,
                    "train.micro_batch_size": row.num("mbs"), "train.global_batch_size": row.num("gbs"),
                    "model.seq_length": row.num("seq"), "optimizer.fsdp": fsdp > 0, "optimizer.distributed": fsdp == 0})
        if ep > 1:
            out["parallel.expert_tensor"] = 1
        if fsdp:
            out["optimizer.overlap_param_gather"] = False
        if tp == 1:
            out["parallel.tp_comm_overlap"] = False
        return out


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {yaml_error_line(exc)}") from None


def _pairs(items: list[str]) -> dict[str, Any]:
    out = {}
    for text in items:
        key, _, value = text.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def _reads_back(text: str) -> bool:
    try:
        return yaml.safe_load(text) == text
    except yaml.YAMLError:
        return False


def _as_overrides(values: dict[str, Any]) -> list[str]:
    def show(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, list):
            return "[" + ",".join(str(x) for x in v) + "]"
        if isinstance(v, str) and not _reads_back(v):  # a pattern such as *E reads back as itself quoted
            return "'" + v.replace("'", "''") + "'"
        return str(v)

    return [f"{k}={show(v)}" for k, v in values.items()]


@dataclass
class RowPlan:
    """The plan of one row: what `--json` prints and what the table shows."""

    row: int
    name: str
    model: str
    system: str
    published: float
    published_flops_per_token: float
    held_out: bool
    predicted_tokens_per_s_per_gpu: float | None = None
    fits: bool | None = None
    flops_per_token: float | None = None
    refused: str | None = None
    memory_gib: float | None = None
    capacity_gib: float | None = None
    margin_gib: float | None = None  # the fit limit less the planned peak
    placement: str | None = None
    overflow: str | None = None
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    erratum: str | None = None  # planned with its release's recipe layout: why, and where from

    @property
    def ratio(self) -> float | None:
        predicted = self.predicted_tokens_per_s_per_gpu
        return None if predicted is None else predicted / self.published

    @property
    def within(self) -> bool:
        return self.ratio is not None and abs(self.ratio - 1) <= TOLERANCE

    @property
    def flops_ratio(self) -> float | None:
        return None if self.flops_per_token is None else self.flops_per_token / self.published_flops_per_token

    @property
    def ok(self) -> bool:
        """Planned, fitting, within ±15% and FLOPs within ±3%."""
        return bool(self.fits and self.within and abs(self.flops_ratio - 1) <= FLOPS_TOLERANCE)

    def json(self) -> dict[str, Any]:
        return {"row": self.row, "predicted_tokens_per_s_per_gpu": self.predicted_tokens_per_s_per_gpu,
                "fits": self.fits, "flops_per_token": self.flops_per_token, "refused": self.refused,
                "erratum": self.erratum}


def published_convention_flops(m: Any, padded_vocab: int) -> float:
    """FLOPs per token as Megatron-Bridge's published figures (containers 25.09–26.04.01) count them: our count
    (`pretrain.observe.flops`, Megatron's accounting) with a GLU counted as gated only when its activation is SiLU
    (SwiGLU, Megatron-LM's `--swiglu`) and every layer's attention full causal (no sliding window). Both differ from
    ours only for GPT-OSS (clamped quick-GELU GLU, 128-token windows on alternate layers); Megatron-Bridge's FLOPs
    utility counts both since its fix #3947 (2026-05-28)."""
    counted = dataclasses.replace(m, sliding_window=None,
                                  gated_linear_unit=m.gated_linear_unit and m.activation == "silu")
    return flops_per_token(counted, padded_vocab)


def plan_row(row: Row, harness: Harness) -> RowPlan:
    """Plan one row (refused with the reason where it cannot be planned). A row with an erratum whose tabulated layout
    is refused or over the GPU's whole memory is planned with its release's recipe layout, and says so."""
    out = _plan_cells(row, harness)
    fix = harness.erratum(row)
    if fix is None:
        return out
    why = errata.cannot(out.refused, out.memory_gib, out.capacity_gib)
    if why is None:
        out.erratum = f"erratum not applied: the table's {errata.layout_text(fix['table'])} runs and fits"
        return out
    fixed = _plan_cells(Row(row.index, errata.corrected(fix, row.cells)), harness)
    fixed.erratum = (f"planned as {errata.layout_text(fix['recipe'])} ({fix['source']}): the table's "
                     f"{errata.layout_text(fix['table'])} {why}")
    return fixed


def _plan_cells(row: Row, harness: Harness) -> RowPlan:
    out = RowPlan(row.index, row.name, row.cells["model"], row.cells["system"], row.published,
                  row.published_flops_per_token, held_out(row.index))
    name = harness.config_name(row)
    if name is None or not (CONFIG_DIR / f"{name}.yaml").is_file():
        out.refused = (f"model not supported yet: no shipped config pretrain/configs/{name}.yaml"
                       if name else f"model not supported yet: no config named for {row.cells['model']!r}")
        return out
    system = harness.models["systems"].get(row.cells["system"])
    if system is None:
        out.refused = f"unknown system {row.cells['system']!r} (known: {', '.join(harness.models['systems'])})"
        return out
    out.config = name
    try:
        values = harness.overrides(row)
        gpus, per_node = row.num("gpus"), system["gpus_per_node"]
        per_node = min(per_node, gpus)
        if gpus % per_node:
            raise PlanError(f"{gpus} GPUs are not whole nodes of {per_node}")
        best = _best_placement(name, values, gpus // per_node, per_node, system["gpu"])
    except (ConfigError, PlanError) as exc:
        out.refused = str(exc)
        return out
    plan, cfg, overrides = best
    world = plan["world_size"]
    cost = plan["cost_model"]
    out.overrides = overrides
    out.placement = _placement_text(cfg.parallel)
    out.predicted_tokens_per_s_per_gpu = plan["layout"]["global_batch_size"] * cfg.model.seq_length / (
        cost["step_s"] * world)
    out.fits = plan["fits"]
    out.memory_gib = plan["memory_gib"]["total"]
    out.capacity_gib = plan["gpu_memory_gib"]
    out.margin_gib = plan["margin_gib"]
    out.overflow = plan.get("overflow")
    out.flops_per_token = published_convention_flops(cfg.model, plan["padded_vocab_size"])
    return out


def _placement_text(p) -> str | None:
    """The placement of the parallel section `p`, in words (None: even stages)."""
    if p.pipeline_layout:
        return p.pipeline_layout
    if p.account_for_embedding_in_pipeline_split:
        return "embedding and loss in the split"
    if p.num_layers_in_first_pipeline_stage is not None:
        return f"first {p.num_layers_in_first_pipeline_stage}, last {p.num_layers_in_last_pipeline_stage}"
    return None


def _best_placement(name: str, values: dict[str, Any], nodes: int, per_node: int, gpu: str):
    """The plan of the row's layout: the even split where PP × VP divides the layers, else the fastest placement
    candidate (`planner.placements`) that passes validation, fitting ones first."""
    from pretrain.planner.placements import placements
    from pretrain.planner.plan import make_plan
    from pretrain.planner.search import uneven_split

    base = {**values, "parallel.num_layers_in_first_pipeline_stage": None,
            "parallel.num_layers_in_last_pipeline_stage": None, "parallel.pipeline_layout": None,
            "parallel.account_for_embedding_in_pipeline_split": False,
            "parallel.account_for_loss_in_pipeline_split": False}
    shipped = load_config(name).optimizer
    if shipped.name == "muon":  # Muon shards its own state (optimizer.muon.layer_wise), not by the DP optimizer
        base.pop("optimizer.distributed")
        base["optimizer.overlap_param_gather"] = shipped.overlap_param_gather
    m = load_config(name, _as_overrides(base)).model
    pp, vp = base["parallel.pipeline"], base["parallel.virtual_pipeline"] or 1
    candidates = placements(m.num_layers, pp, vp, bool(m.mtp_num_layers), uneven_split(m.num_layers, pp, vp))
    if not candidates:
        raise PlanError(f"{m.num_layers} layers cannot be placed on PP{pp} x VP{vp}")
    plans, errors = [], []
    for place in candidates:
        overrides = _as_overrides(base) + place.overrides()
        cfg = load_config(name, overrides)
        try:
            plan = make_plan(cfg, nodes, per_node, gpu, name=name)
        except PlanError as exc:
            errors.append(str(exc))
            continue
        plans.append((plan, cfg, overrides))
    if not plans:
        raise PlanError(errors[0] if len(set(errors)) == 1 else " / ".join(errors))
    return max(plans, key=lambda p: (p[0]["fits"], -p[0]["cost_model"]["step_s"]))


def summary(plans: list[RowPlan]) -> dict[str, Any]:
    """Counts over the rows of supported models (those not refused as unsupported)."""
    supported = [p for p in plans if not (p.refused or "").startswith("model not supported yet")]
    planned = [p for p in supported if p.refused is None]
    return {"rows": len(plans), "supported": len(supported), "planned": len(planned),
            "fit": sum(bool(p.fits) for p in planned), "within": sum(p.within and bool(p.fits) for p in planned),
            "flops_within": sum(abs(p.flops_ratio - 1) <= FLOPS_TOLERANCE for p in planned),
            "ok": sum(p.ok for p in planned)}


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def planning_inputs(row: Row, harness: Harness, system: bool = True) -> str | None:
    """What the harness plans `row` from, as one comparable string: our config, the system (unless `system` is
    False), the GPUs and every override. Two rows with equal inputs get one prediction, whatever their container;
    None where the row cannot be planned."""
    try:
        values = harness.overrides(row)
    except (PlanError, KeyError):
        return None
    where = [row.cells["system"]] if system else []
    values = {k: sorted(v) if isinstance(v, list) else v for k, v in values.items()}  # a graph scope is a set
    return json.dumps([harness.config_name(row), *where, row.cells["gpus"], values], sort_keys=True, default=str)


def as_planned(row: Row, plan: RowPlan, harness: Harness) -> Row:
    """The row with the cells it was planned with: its erratum's layout where `plan` applied one, else itself."""
    fix = harness.erratum(row)
    if fix is None or not (plan.erratum or "").startswith("planned as"):
        return row
    return Row(row.index, errata.corrected(fix, row.cells))


def twins(rows: list[Row], harness: Harness, system: bool = True) -> list[list[Row]]:
    """Groups of two or more rows planned from equal inputs (`planning_inputs`), in table order; with `system` False,
    those equal but for the GPU kind, within one container (two or more systems)."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        key = planning_inputs(row, harness, system)
        if key is not None:
            groups.setdefault(key if system else f"{row.cells['container']}|{key}", []).append(row)
    out = [g for g in groups.values() if len(g) > 1]
    return out if system else [g for g in out if len({r.cells["system"] for r in g}) > 1]


def must_miss(group: list[Row]) -> int:
    """Rows of a twin group that no prediction meets: one prediction is within ±TOLERANCE of rows whose published
    figures span at most (1 + TOLERANCE) / (1 - TOLERANCE); the rest of the group, outside the largest such span,
    misses whatever the model."""
    figures = sorted(r.published for r in group)
    span = (1 + TOLERANCE) / (1 - TOLERANCE)
    best = max(sum(1 for f in figures if low <= f <= low * span) for low in figures)
    return len(group) - best
