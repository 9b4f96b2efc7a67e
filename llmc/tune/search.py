"""`llmc tune`: sensitivities measured once, the frontier of mixes solved from them, then real quantize-and-evaluate
runs: every uniform recipe, the best mix at the cost of each `match_cost_of` candidate, and a bisection along the
frontier for the cheapest mix that passes the gate. Everything lives in a work folder beside the output
(`OUTPUT.tune-work`): a killed tune resumes from its last finished evaluation. The winner's artifact, its recipe
and the tune's report are then moved into OUTPUT in one rename."""
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

import llmc
from llmc.artifact.export_config import ExportConfig
from llmc.artifact.resume import REPORT_DIR
from llmc.artifact.writer import MANIFEST, RECIPE, write_manifest
from llmc.calib.data import CalibrationSet, load_calibration
from llmc.calib.driver import SourceModel, build_skeleton
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.checkpoints.families import family_for
from llmc.checkpoints.spec import resolve_model
from llmc.core.device import describe_device, resolve_device
from llmc.core.errors import LlmcError
from llmc.core.staging import check_output, move_into_place, unique_sibling
from llmc.evals.gate import GateFailed, check_gate
from llmc.evals.inputs import EvalInputs, load_eval_inputs
from llmc.evals.report import summary, write_report
from llmc.evals.suite import EvalTarget, Measured, compare, measure
from llmc.pipeline.quantize import export_dtype, run_quantize
from llmc.pipeline.recipe import Recipe
from llmc.tune.chart import write_tune_report
from llmc.tune.config import TuneConfig, candidate_formats
from llmc.tune.hardware import decode_tokens_per_second, gpu_refusal
from llmc.tune.sensitivity import Objective, Unit, measure_units
from llmc.tune.solve import Mix, frontier, least_error_within, mix_of

STATE = "tune.json"
TUNE_DIR = "tune"  # in the output: the tune's report, chart, every point's recipe and report
GATE_METRICS = ("perplexity_increase", "recovery", "agreement", "kl")


@dataclass
class Point:
    """One quantize-and-evaluate run."""

    name: str
    kind: str  # uniform, frontier, matched
    choice: list[str]  # per unit, its candidate label
    cost: float
    predicted: float
    metrics: dict  # the comparison with the baseline: perplexity_increase, recovery, agreement, kl
    passed: bool
    failures: list[str]
    seconds: float  # quantize and evaluate
    counts: dict = field(default_factory=dict)  # candidate label -> units
    tokens_per_second: float | None = None  # batch-1 decode here, measured for the winner and the best uniform
    accepted_length: float | None = None  # the winner's draft, when the tune trains one


@dataclass
class TuneState:
    """What the work folder's tune.json holds, saved after each step."""

    fingerprint: dict
    units: list[Unit] | None = None
    points: dict[str, Point] = field(default_factory=dict)
    kept: str | None = None  # the point whose artifact is kept in the work folder (the cheapest passing when it ran)
    sensitivity_s: float = 0.0

    @property
    def winner(self) -> "Point | None":
        """The cheapest point that passed the gate."""
        return min((point for point in self.points.values() if point.passed), key=lambda point: point.cost, default=None)

    def folder_of(self, work: Path, point: "Point") -> Path:
        """The point's recipe and report: those of the run of its assignment (a point reported under a second name
        was not run again)."""
        ran = next(other for other in self.points.values() if other.choice == point.choice and other.seconds > 0)
        return work / "points" / _folder_name(ran.name)

    def rejudge(self, work: Path, gate) -> None:
        """Every point judged again by `gate` from its saved report: a resumed tune may change its thresholds."""
        for point in self.points.values():
            judged = check_gate(json.loads((self.folder_of(work, point) / "report.json").read_text()), gate)
            point.passed, point.failures = judged.passed, judged.failures

    def save(self, work: Path) -> None:
        data = {"fingerprint": self.fingerprint, "units": None if self.units is None else [unit.to_dict() for unit in self.units],
                "points": {name: asdict(point) for name, point in self.points.items()}, "kept": self.kept,
                "sensitivity_s": self.sensitivity_s}
        partial = work / f"{STATE}.partial"
        partial.write_text(json.dumps(data, indent=1) + "\n")
        partial.replace(work / STATE)

    @classmethod
    def load(cls, work: Path) -> "TuneState":
        data = json.loads((work / STATE).read_text())
        units = None if data["units"] is None else [Unit(**unit) for unit in data["units"]]
        points = {name: Point(**point) for name, point in data["points"].items()}
        return cls(data["fingerprint"], units, points, data["kept"], data["sensitivity_s"])


def work_folder(output: Path) -> Path:
    return output.with_name(f"{output.name}.tune-work")


def open_state(work: Path, fingerprint: dict, resume: bool, discard_partial: bool) -> TuneState:
    if work.exists() and discard_partial:
        shutil.rmtree(work)
    if work.exists():
        if not resume:
            raise LlmcError(f"{work} holds a stopped tune: rerun with --resume to continue it, or --discard-partial to start again")
        if not (work / STATE).is_file():
            raise LlmcError(f"{work} is not a tune's work folder (no {STATE}); remove it")
        state = TuneState.load(work)
        if state.fingerprint != fingerprint:
            raise LlmcError(f"{work} holds a tune of another configuration; --discard-partial starts this one afresh")
        return state
    work.mkdir(parents=True)
    state = TuneState(fingerprint)
    state.save(work)
    return state


def objective_of(config: TuneConfig, dtype: torch.dtype) -> Objective:
    if isinstance(config.objective, str):
        return Objective(config.objective, None, dtype)
    return Objective("gpu", config.objective.target, dtype)


def allowed_labels(config: TuneConfig, objective: Objective) -> set[str]:
    allowed = set()
    for candidate in config.candidates:
        refusal = objective.gpu and not candidate.keep and gpu_refusal(candidate.scheme, objective.gpu)
        if refusal:
            print(f"candidate {candidate.label} left out: {refusal}", file=sys.stderr)
        else:
            allowed.add(candidate.label)
    return allowed


class Evaluator:
    """Runs points (quantize, then evaluate against the baseline, measured once), at most max_evaluations of them."""

    def __init__(self, config: TuneConfig, units: list[Unit], state: TuneState, work: Path, inputs: EvalInputs,
                 device: torch.device):
        self.config, self.units, self.state, self.work, self.inputs, self.device = config, units, state, work, inputs, device
        self.base: Measured | None = None

    @property
    def left(self) -> int:
        """Evaluations left: points of the same assignment count once."""
        return self.config.max_evaluations - len({tuple(point.choice) for point in self.state.points.values()})

    def recipe_data(self, output: Path, mix: Mix) -> dict:
        by_label: dict[str, list[str]] = {}
        for unit, label in zip(self.units, mix.choice):
            by_label.setdefault(label, []).extend(unit.names)
        stages = [self.config.weight_stage(candidate, sorted(by_label[candidate.label]))
                  for candidate in self.config.candidates if not candidate.keep and candidate.label in by_label]
        return self.config.recipe_data(str(output), stages)

    def quantize(self, artifact: Path, mix: Mix) -> dict:
        """The mix quantized into artifact (its evals left to `evaluate`, no draft); the recipe's data."""
        data = self.recipe_data(artifact, mix)
        run_quantize(Recipe.model_validate(point_recipe(data)), overwrite=True, discard_partial=True)
        return data

    def point(self, name: str, kind: str, mix: Mix) -> Point | None:
        """The point's result: recorded before, run now, or None when the evaluations are spent."""
        if name in self.state.points:
            return self.state.points[name]
        same = next((point for point in self.state.points.values() if tuple(point.choice) == mix.choice), None)
        if same is not None:  # the same assignment as a point run before (the cheapest mix may be a uniform one)
            self.state.points[name] = replace(same, name=name, kind=kind, seconds=0.0, tokens_per_second=None,
                                              accepted_length=None)
            self.state.save(self.work)
            return self.state.points[name]
        if self.left <= 0:
            return None
        started = time.perf_counter()
        print(f"\n[tune] {name}: {_counts_text(mix.counts())}, cost {mix.cost:.4g}, predicted error {mix.predicted:.4g} "
              f"({self.config.max_evaluations - self.left + 1} of at most {self.config.max_evaluations} evaluations)",
              file=sys.stderr)
        artifact = self.work / "artifacts" / _folder_name(name)
        data = self.quantize(artifact, mix)
        report = self.evaluate(name, artifact)
        folder = self.work / "points" / _folder_name(name)
        write_report(report, folder)
        (folder / RECIPE).write_text(Recipe.model_validate(data).to_yaml())
        gate = report["gate"]
        metrics = {key: value for key, value in report["targets"][name]["vs_baseline"].items() if key in GATE_METRICS}
        if "perplexity" in report["targets"][name]:
            metrics["perplexity"] = report["targets"][name]["perplexity"]["perplexity"]
        point = Point(name, kind, list(mix.choice), mix.cost, mix.predicted, metrics, gate["passed"], gate["failures"],
                      time.perf_counter() - started, mix.counts())
        self.keep_cheapest_passing(point, artifact, report)
        self.state.points[name] = point
        self.state.save(self.work)
        print(f"[tune] {name}: {'passes' if point.passed else 'fails'} the gate ({_metrics_text(metrics)})", file=sys.stderr)
        return point

    def evaluate(self, name: str, artifact: Path) -> dict:
        settings = self.config.eval
        if self.base is None:
            self.base = measure(EvalTarget("baseline", self.config.model), settings, self.inputs, self.device)
        measured = measure(EvalTarget(name, str(artifact)), settings, self.inputs, self.device)
        measured.report["vs_baseline"] = compare(self.base, measured, self.inputs.items, name)
        report = {"baseline": "baseline", "settings": settings.model_dump(mode="json", exclude={"gate"}),
                  "targets": {"baseline": self.base.report, name: measured.report}}
        report["gate"] = check_gate(report, settings.gate).to_dict()
        return report

    def keep_cheapest_passing(self, point: Point, artifact: Path, report: dict) -> None:
        kept = self.state.points.get(self.state.kept) if self.state.kept else None
        cheapest = self.state.winner
        if point.passed and (cheapest is None or point.cost < cheapest.cost):
            write_report(report, artifact / REPORT_DIR)
            if kept is not None:
                shutil.rmtree(self.work / "artifacts" / _folder_name(kept.name), ignore_errors=True)
            self.state.kept = point.name
        else:
            shutil.rmtree(artifact, ignore_errors=True)


def point_recipe(data: dict) -> dict:
    """A point's recipe as it is quantized: evaluated afterwards against one baseline, and with no draft (the winner's
    alone is trained)."""
    return {**data, "eval": {"baseline": False}, "draft": None}


def _folder_name(name: str) -> str:
    return "".join(char if char.isalnum() or char in "-_." else "-" for char in name)


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{count} {label}" for label, count in counts.items())


def _metrics_text(metrics: dict) -> str:
    return ", ".join(f"{key} {value:.4g}" for key, value in metrics.items() if value is not None)


def bisect_frontier(evaluator: Evaluator, mixes: list[Mix]) -> None:
    """The cheapest passing frontier mix, taking the gate as monotone in predicted error (a mix passes when one
    predicted worse does). Points known already narrow the bracket: a mix predicted at least as bad as a failing one
    is taken to fail; the first mix predicted no worse than the worst passing one is evaluated first. Each probe then
    halves the log range of predicted error between the dearest mix known to fail and the cheapest known to pass (an
    all-keep mix passes unevaluated: it is the base model)."""
    known = list(evaluator.state.points.values())
    failing = [point.predicted for point in known if not point.passed]
    low = max((index for index, mix in enumerate(mixes) if failing and mix.predicted >= min(failing)), default=-1)
    high = len(mixes) - 1
    passing = [point.predicted for point in known if point.passed]
    candidates = [index for index, mix in enumerate(mixes) if passing and low < index and mix.predicted <= max(passing)]
    if candidates:
        first = evaluator.point(f"frontier {candidates[0]}", "frontier", mixes[candidates[0]])
        if first is None:
            return
        low, high = (low, candidates[0]) if first.passed else (candidates[0], high)
    if mixes[high].predicted > 0:  # the dearest mix is not the base model: it must pass for the bracket to hold
        top = evaluator.point(f"frontier {high}", "frontier", mixes[high])
        if top is None or not top.passed:
            if top is not None:
                print("[tune] the most accurate mix fails the gate: add more accurate candidates (keep, W8A16)", file=sys.stderr)
            return
    while high - low > 1:
        probe = _probe(mixes, low, high)
        point = evaluator.point(f"frontier {probe}", "frontier", mixes[probe])
        if point is None:
            return
        low, high = (low, probe) if point.passed else (probe, high)


def _probe(mixes: list[Mix], low: int, high: int) -> int:
    """Between low and high, the mix whose predicted error is nearest their geometric mean (the index midpoint
    where one of them is unbounded or exact)."""
    if low < 0 or mixes[high].predicted <= 0:
        return (low + high) // 2 if low >= 0 else max(0, (high - 1) // 2)
    target = (mixes[low].predicted * mixes[high].predicted) ** 0.5
    inside = range(low + 1, high)
    return min(inside, key=lambda index: abs(mixes[index].predicted - target))


def run_tune(config: TuneConfig, overwrite: bool = False, resume: bool = False, discard_partial: bool = False) -> Path:
    output = Path(config.output)
    check_output(output, overwrite)
    work = work_folder(output)
    device = resolve_device(config.device)
    print(f"device: {describe_device(device)}", file=sys.stderr)
    inputs = load_eval_inputs(config.eval)
    folder = resolve_model(config.model)
    if config.draft is not None:  # what the draft will need, checked before the work it follows
        from llmc.draft.build import checked_draft_inputs

        checked_draft_inputs(folder, config.draft, device)
    hf_config = AutoConfig.from_pretrained(folder)
    family = family_for(hf_config)
    dtype = export_dtype(ExportConfig(), hf_config)  # a tune's recipes leave the export section at its defaults
    objective = objective_of(config, dtype)
    allowed = allowed_labels(config, objective)
    formats = {label: chosen for label, chosen in candidate_formats(config).items() if label in allowed}
    # what the measurements depend on: a resumed tune may change where the winner goes, the evaluations allowed and the
    # gate's thresholds (every point is judged again)
    fingerprint = {"config": config.model_dump(mode="json", exclude={"output": True, "max_evaluations": True, "eval": {"gate"}}),
                   "llmc": llmc.__version__}
    state = open_state(work, fingerprint, resume, discard_partial)
    state.rejudge(work, config.eval.gate)
    if state.units is None:
        measuring = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        calibration = load_calibration(config.calibration, tokenizer)
        sample = CalibrationSet(calibration.input_ids[: config.sensitivity_samples], calibration.source, calibration.compute_dtype)
        model = SourceModel(CheckpointReader(folder), build_skeleton(hf_config), hf_config, family)
        state.units = measure_units(model, sample, formats, objective, device, dtype)
        state.sensitivity_s = time.perf_counter() - measuring
        state.save(work)
    units = state.units
    for point in state.points.values():  # cost and prediction from the sensitivities as they now stand
        mix = mix_of(units, point.choice)
        point.cost, point.predicted = mix.cost, mix.predicted
    mixes = frontier(units, allowed)
    print(f"[tune] {len(units)} units, {len(formats)} formats: {len(mixes)} mixes on the frontier", file=sys.stderr)
    evaluator = Evaluator(config, units, state, work, inputs, device)
    uniform = {label: mix_of(units, [label] * len(units)) for label in allowed
               if label in formats and formats[label] is not None and all(label in unit.error for unit in units)}
    if config.uniform:
        for label, mix in sorted(uniform.items(), key=lambda item: item[1].cost):
            evaluator.point(f"uniform {label}", "uniform", mix)
    for label in config.match_cost_of:
        if label not in uniform:
            print(f"[tune] match_cost_of {label}: it does not fit every Linear, so it has no uniform cost", file=sys.stderr)
            continue
        index = least_error_within(mixes, uniform[label].cost)
        if index is not None:
            evaluator.point(f"at the cost of {label}", "matched", mixes[index])
    bisect_frontier(evaluator, mixes)
    searched = time.perf_counter()
    spent = sum(point.seconds for point in state.points.values())
    used = config.max_evaluations - evaluator.left
    print(f"[tune] spent {used} of at most {config.max_evaluations} evaluations ({spent / 60:.1f} min) and "
          f"{state.sensitivity_s / 60:.1f} min measuring sensitivities", file=sys.stderr)
    if state.winner is None:
        write_tune_report(config, state, work / TUNE_DIR, state.sensitivity_s + spent, objective.unit)
        raise GateFailed(f"no evaluated mix passes the gate; every point's report: {work / TUNE_DIR / 'report.md'}")
    if config.draft is not None:
        train_winner_draft(config, evaluator)
    if objective.gpu is None:  # the GPU's speed is modelled; this machine's is measured
        measure_decode(evaluator)
    work_s = state.sensitivity_s + spent + (time.perf_counter() - searched)  # a resumed tune's earlier work counted
    return publish(config, evaluator, output, overwrite, work_s, objective.unit)


def winner_artifact(evaluator: Evaluator, winner: Point) -> Path:
    """The winner's artifact in the work folder, quantized again if a later point's artifact was kept instead (a
    resumed tune with other thresholds may choose a point whose artifact was removed)."""
    state, work = evaluator.state, evaluator.work
    kept = state.points.get(state.kept) if state.kept else None
    if kept is not None and kept.choice == winner.choice:
        return work / "artifacts" / _folder_name(kept.name)
    artifact = work / "artifacts" / _folder_name(winner.name)
    evaluator.quantize(artifact, mix_of(evaluator.units, winner.choice))
    write_report(json.loads((state.folder_of(work, winner) / "report.json").read_text()), artifact / REPORT_DIR)
    if kept is not None:
        shutil.rmtree(work / "artifacts" / _folder_name(kept.name), ignore_errors=True)
    state.kept = winner.name
    state.save(work)
    return artifact


def train_winner_draft(config: TuneConfig, evaluator: Evaluator) -> None:
    """The draft heads trained on the winner, and the gate's min_accepted_length checked on them."""
    state, work = evaluator.state, evaluator.work
    from llmc.draft.build import train_draft
    from llmc.evals.gate import check_accepted_length
    from llmc.runtime.speculative.store import read_draft_config

    winner = state.winner
    artifact = winner_artifact(evaluator, winner)
    if winner.accepted_length is None:
        folder = train_draft(artifact, config.draft, evaluator.device)
        winner.accepted_length = (read_draft_config(folder)["heldout_acceptance"] or {}).get("mean_accepted_length", 1.0)
        state.save(work)
    check_accepted_length(winner.accepted_length, config.eval.gate,
                          f"the draft of the winner ({winner.name}) on its held-out prompts, nothing written; the tune "
                          f"is kept in {work}")


def measure_decode(evaluator: Evaluator) -> None:
    """Batch-1 decode tok/s of the winner and of the fastest uniform recipe that passed (quantized again: only the
    winner's artifact is kept)."""
    state, work = evaluator.state, evaluator.work
    winner = state.winner
    if winner.tokens_per_second is None:
        winner.tokens_per_second = decode_tokens_per_second(winner_artifact(evaluator, winner))
        state.save(work)
    passing = [point for point in state.points.values() if point.kind == "uniform" and point.passed]
    best = min(passing, key=lambda point: point.cost, default=None)
    if best is None or best.tokens_per_second is not None:
        return
    if best.choice == winner.choice:
        best.tokens_per_second = winner.tokens_per_second
    else:
        artifact = work / "artifacts" / f"speed-{_folder_name(best.name)}"
        evaluator.quantize(artifact, mix_of(evaluator.units, best.choice))
        best.tokens_per_second = decode_tokens_per_second(artifact)
        shutil.rmtree(artifact, ignore_errors=True)
    state.save(work)


def publish(config: TuneConfig, evaluator: Evaluator, output: Path, overwrite: bool, seconds: float, unit: str) -> Path:
    state, work = evaluator.state, evaluator.work
    winner = state.winner
    artifact = winner_artifact(evaluator, winner)
    recipe = Recipe.model_validate(evaluator.recipe_data(output, mix_of(evaluator.units, winner.choice)))
    (artifact / RECIPE).write_text(recipe.to_yaml())
    write_tune_report(config, state, artifact / TUNE_DIR, seconds, unit)
    shutil.copytree(work / "points", artifact / TUNE_DIR / "points")
    manifest = json.loads((artifact / MANIFEST).read_text())
    report = json.loads((state.folder_of(work, winner) / "report.json").read_text())
    manifest |= {"eval": summary(report), "tune": {"winner": winner.name, "report": f"{TUNE_DIR}/report.md"}}
    write_manifest(artifact, {key: value for key, value in manifest.items() if key != "files"})  # files hashed again
    staging = unique_sibling(output, "tune")
    artifact.rename(staging)
    move_into_place(staging, output, overwrite)
    shutil.rmtree(work, ignore_errors=True)
    print(f"[tune] {winner.name} wins: {_counts_text(winner.counts)}; {output}", file=sys.stderr)
    return output
