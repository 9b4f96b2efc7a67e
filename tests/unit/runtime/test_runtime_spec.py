import math
import time
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from llmc.draft.build import train_eagle
from llmc.draft.config import DraftConfig
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.draft_tree import ROOT, DraftTree
from llmc.runtime.layers.linear import Int8CpuLinear
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.speculative.acceptance import greedy_accept, rejection_sample
from llmc.runtime.speculative.governor import DraftGovernor
from llmc.runtime.speculative.proposers import Observed, add_level, most_probable_nodes


@pytest.fixture(scope="module")
def trained_eagle(tmp_path_factory, tiny_llama, distilled, trained) -> Path:
    folder = tmp_path_factory.mktemp("eagle")
    train_eagle(distilled, DraftConfig(method="eagle", steps=150, batch_size=64, lr=3e-3), folder, tiny_llama)
    return folder


@pytest.mark.parametrize("tree_nodes", [0, 8], ids=["chain", "tree"])
@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(1, 512), (4, 7)])
def test_eagle_greedy_output_equals_plain_decoding(tiny_llama, trained, trained_eagle, tree_nodes, max_num_seqs, max_num_batched_tokens):
    _, prompts = trained
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    limits = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    plain = build(tiny_llama, **limits).generate(prompts, params)
    engine = build(tiny_llama, speculative=trained_eagle, num_speculative_tokens=3, speculative_tree_nodes=tree_nodes, **limits)
    speculative = engine.generate(prompts, params)
    assert [out["token_ids"] for out in speculative] == [out["token_ids"] for out in plain]
    stats = engine.runner.speculator.stats
    assert stats.num_drafts > 0 and stats.mean_accepted_length > 1.2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_eagle_tree_keeps_the_most_probable_paths():
    tree = DraftTree([1, 2, 3, 4, 5], [-1, -1, 0, 0, 1])
    kept = most_probable_nodes(tree, [-0.1, -1.0, -0.3, -2.0, -1.5], 3)
    assert kept == DraftTree([1, 2, 3], [-1, -1, 0])


def test_a_tree_keeps_only_nodes_the_draft_is_confident_of():
    tree = DraftTree([1, 2, 3, 4, 5], [-1, -1, 0, 0, 1])
    scores = [-0.1, -1.0, -0.3, -2.0, -1.5]
    assert most_probable_nodes(tree, scores, 5, min_score=-0.5) == DraftTree([1, 3], [-1, 0])
    assert most_probable_nodes(tree, scores, 5, min_score=-1.0) == DraftTree([1, 2, 3], [-1, -1, 0])
    assert most_probable_nodes(tree, scores, 5, min_score=-0.05) == DraftTree()


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_a_tree_wider_than_four_paths_per_level_is_filled_and_stays_exact(tiny_llama, trained, trained_eagle, method):
    """A tree of 18 nodes over 2 levels keeps 9 paths per level (EAGLE-2's trees are 60 nodes over 6 levels)."""
    draft, prompts = trained
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    folder = draft if method == "medusa" else trained_eagle
    engine = build(tiny_llama, speculative=folder, num_speculative_tokens=2, speculative_tree_nodes=18)
    assert engine.runner.speculator.proposer.top_k == 9
    speculative = [out["token_ids"] for out in engine.generate(prompts, params)]
    assert speculative == [out["token_ids"] for out in build(tiny_llama).generate(prompts, params)]
    stats = engine.runner.speculator.stats
    assert stats.num_draft_tokens / stats.num_drafts > 16  # more than 4 paths x 2 levels


@pytest.mark.parametrize("method, threshold", [("medusa", 0.3), ("eagle", 0.05)])
def test_a_confidence_threshold_drafts_fewer_nodes_and_keeps_greedy_output_exact(tiny_llama, trained, trained_eagle, method, threshold):
    draft, prompts = trained
    folder = draft if method == "medusa" else trained_eagle
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = build(tiny_llama).generate(prompts, params)
    stats = {}
    for min_confidence in (0.0, threshold):
        engine = build(tiny_llama, speculative=folder, num_speculative_tokens=3, speculative_tree_nodes=6,
                       speculative_min_confidence=min_confidence)
        assert [out["token_ids"] for out in engine.generate(prompts, params)] == [out["token_ids"] for out in plain]
        stats[min_confidence] = engine.runner.speculator.stats
    every, confident = stats[0.0], stats[threshold]
    assert confident.num_draft_tokens / confident.num_steps < every.num_draft_tokens / every.num_steps
    # the nodes kept are the likeliest to be accepted: each verified node is accepted more often
    assert confident.num_accepted_tokens / confident.num_draft_tokens > every.num_accepted_tokens / every.num_draft_tokens
    assert every.tokens_per_step == pytest.approx(1 + every.num_accepted_tokens / every.num_steps)


def test_eagle_feeds_only_confident_nodes_into_its_layer(tiny_llama, trained, trained_eagle, monkeypatch):
    """A path below the confidence threshold has no descendant above it, so each drafted level feeds the EAGLE layer
    only its nodes at or above the threshold (before, the level's 4 best paths went in whatever their probability)."""
    _, prompts = trained
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    threshold = 0.05
    engine = build(tiny_llama, speculative=trained_eagle, num_speculative_tokens=4, speculative_tree_nodes=8,
                   speculative_min_confidence=threshold)
    proposer = engine.runner.speculator.proposer
    draft_forward, drafting, fed, levels = proposer.draft.forward, proposer._draft, [], []

    def recording_level(tree, scores, *args):
        level = add_level(tree, scores, *args)
        levels.append([scores[node] for node in level])
        return level

    def recording_draft(cache):
        proposer.draft.forward = lambda features, *args: fed.append((len(levels), features.shape[1])) or draft_forward(features, *args)
        try:
            return drafting(cache)
        finally:
            del proposer.draft.forward

    monkeypatch.setattr(proposer, "_draft", recording_draft)
    monkeypatch.setattr("llmc.runtime.speculative.proposers.add_level", recording_level)
    speculative = [out["token_ids"] for out in engine.generate(prompts, params)]
    assert speculative == [out["token_ids"] for out in build(tiny_llama).generate(prompts, params)]
    confident = [sum(score >= math.log(threshold) for score in levels[index - 1]) for index, _ in fed]
    assert fed and [rows for _, rows in fed] == confident
    assert any(len(levels[index - 1]) > rows for index, rows in fed)  # some unconfident node was left out


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_bfloat16_drafts_read_int8_weights_and_greedy_output_stays_exact(tiny_llama, trained, trained_eagle, method):
    draft, prompts = trained
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    settings = dict(dtype=torch.bfloat16, block_size=4, num_kv_blocks=48, adaptive_speculation=False, speculative_tree_nodes=6,
                    speculative_min_confidence=0.0)
    engine = LLM(tiny_llama, EngineConfig(speculative=draft if method == "medusa" else trained_eagle, **settings))
    proposer = engine.runner.speculator.proposer
    heads = proposer.heads if method == "medusa" else proposer.draft
    linears = [module for module in heads.modules() if isinstance(module, Int8CpuLinear)]
    assert linears and not any(isinstance(module, torch.nn.Linear) for module in heads.modules())
    assert method == "medusa" or isinstance(proposer.guess, Int8CpuLinear)
    plain = LLM(tiny_llama, EngineConfig(dtype=torch.bfloat16, block_size=4, num_kv_blocks=48))
    assert [out["token_ids"] for out in engine.generate(prompts, params)] == [out["token_ids"] for out in plain.generate(prompts, params)]
    assert engine.runner.speculator.stats.num_accepted_tokens > 0


def test_a_tree_level_keeps_the_most_probable_paths_below_any_node():
    tree, scores = DraftTree(), []
    first = add_level(tree, scores, [ROOT], torch.tensor([[-0.1, -1.0]]), torch.tensor([[5, 6]]))
    assert first == [0, 1] and tree == DraftTree([5, 6], [ROOT, ROOT])
    # both nodes offer the same guesses (Medusa's heads do not see the path): the best two paths of four are kept
    second = add_level(tree, scores, first, torch.tensor([[-0.2, -0.5]] * 2), torch.tensor([[7, 8]] * 2))
    assert second == [2, 3] and tree.tokens[2:] == [7, 8] and tree.parents[2:] == [0, 0]
    assert scores == pytest.approx([-0.1, -1.0, -0.3, -0.6])
    third = add_level(tree, scores, second, torch.tensor([[-0.1, -2.0], [-0.1, -2.0]]), torch.tensor([[9, 4], [3, 9]]))
    assert [tree.parents[node] for node in third] == [2, 3] and [tree.tokens[node] for node in third] == [9, 3]


def build(model: Path, **kwargs) -> LLM:
    # draft every step, a chain of every node the draft guesses, unless a test says otherwise
    settings = {"num_kv_blocks": 48, "adaptive_speculation": False, "speculative_tree_nodes": 0, "speculative_min_confidence": 0.0} | kwargs
    return LLM(model, EngineConfig(dtype=torch.float32, block_size=4, **settings))


@pytest.mark.parametrize("tree_nodes", [0, 6], ids=["chain", "tree"])
@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(1, 512), (4, 512), (4, 7)])
def test_greedy_speculative_output_equals_plain_decoding(tiny_llama, trained, tree_nodes, max_num_seqs, max_num_batched_tokens):
    draft, prompts = trained
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    limits = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    plain = build(tiny_llama, **limits).generate(prompts, params)
    engine = build(tiny_llama, speculative=draft, speculative_tree_nodes=tree_nodes, **limits)
    speculative = engine.generate(prompts, params)
    assert [out["token_ids"] for out in speculative] == [out["token_ids"] for out in plain]
    stats = engine.runner.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.mean_accepted_length > 1 and sum(stats.accepted_lengths.values()) == stats.num_drafts
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # rejected drafts' slots came back


def test_speculation_turns_off_under_load(tiny_llama, trained):
    draft, prompts = trained
    assert len(prompts) > 1
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = [out["token_ids"] for out in build(tiny_llama, num_kv_blocks=256).generate(prompts, params)]
    engine = build(tiny_llama, speculative=draft, speculative_max_num_seqs=1, num_kv_blocks=256)  # all run at once
    assert [out["token_ids"] for out in engine.generate(prompts, params)] == plain
    assert engine.runner.speculator.stats.num_drafts == 0
    # the same prompts under a limit they fit in are drafted for, so the zero above is the limit's doing
    engine = build(tiny_llama, speculative=draft, speculative_max_num_seqs=len(prompts), num_kv_blocks=256)
    assert [out["token_ids"] for out in engine.generate(prompts, params)] == plain
    assert engine.runner.speculator.stats.num_drafts > 0


def test_governor_measures_both_ways_then_drafts_only_while_it_wins_probing_the_other_way():
    governor = DraftGovernor(probe_every=4)
    assert governor.should_draft(1) is True  # nothing measured: try drafting first
    governor.record(1, True, num_tokens=3, seconds=1.0)
    assert governor.should_draft(1) is False  # then plain decoding
    governor.record(1, False, num_tokens=1, seconds=0.5)
    assert governor.rate(1, True) == 3.0 and governor.rate(1, False) == 2.0
    assert [governor.should_draft(1) for _ in range(6)] == [True, True, True, False, True, True]  # the 4th probes
    for _ in range(8):  # drafts stop paying: the moving average of accepted tokens follows
        governor.record(1, True, num_tokens=1, seconds=1.0)
    assert governor.rate(1, True) < governor.rate(1, False) and [governor.should_draft(1) for _ in range(4)] == [False, False, False, True]


def test_governor_probes_a_steady_loser_less_and_less_and_starts_over_when_the_winner_changes():
    governor = DraftGovernor(probe_every=16, max_probe_every=512)
    governor.record(1, True, num_tokens=1, seconds=1.0)
    governor.record(1, False, num_tokens=1, seconds=0.5)
    probes = [index + 1 for index in range(2000) if governor.should_draft(1)]
    assert probes == [16, 48, 112, 240, 496, 1008, 1520]  # waits of 16, 32, ... 512 decisions
    governor.record(1, True, num_tokens=10, seconds=0.25)  # the last probe found drafts paying now
    assert [governor.should_draft(1) for _ in range(16)] == [True] * 15 + [False]


def test_governor_times_steps_per_batch_size_and_pools_acceptance_over_all_of_them():
    """Plain steps of 8 sequences output far more tokens per second than drafted steps of 2: step times are only
    compared at one batch size. How far drafts are accepted is the draft's and the text's, so drafts at any batch
    size tell every batch size's decision."""
    governor = DraftGovernor()
    governor.record(8, False, num_tokens=8, seconds=0.1)
    assert governor.should_draft(2) is True
    governor.record(2, True, num_tokens=5, seconds=0.1)
    assert governor.should_draft(2) is False
    governor.record(2, False, num_tokens=2, seconds=0.05)
    assert governor.should_draft(2) is True and governor.should_draft(8) is True  # 50 > 40 tokens/s at 2; 8 unmeasured drafted
    governor.record(8, True, num_tokens=20, seconds=0.4)
    assert governor.tokens_per_drafted_step == 2.5  # per sequence, at 2 and at 8
    assert governor.should_draft(8) is False and governor.should_draft(2) is True  # 50 < 80 at 8, 50 > 40 at 2
    at_8 = governor.rate(8, True)
    for _ in range(10):  # the drafts stop being accepted, seen at batch size 2 only
        governor.record(2, True, num_tokens=2, seconds=0.1)
    assert governor.rate(2, True) < governor.rate(2, False)
    assert governor.rate(8, True) / at_8 == pytest.approx(governor.rate(2, True) / 50)  # batch 8 knows it too


def eagle_paused_for_8_steps(tiny_llama: Path, trained_eagle: Path) -> LLM:
    """An EAGLE engine whose governor drafts the first 3 decisions, pauses for the next 8, then drafts on."""
    engine = build(tiny_llama, speculative=trained_eagle, adaptive_speculation=True, num_speculative_tokens=3, speculative_tree_nodes=6)
    decisions = iter([True] * 3 + [False] * 8 + [True] * 100)
    engine.runner.speculator.governor.should_draft = lambda num_seqs: next(decisions)
    return engine


def test_a_pause_is_caught_up_off_the_clock_of_the_step_that_resumes_drafting(tiny_llama, trained, trained_eagle, monkeypatch):
    """The pairs that waited while drafting was off go into the EAGLE layer when it resumes: deferred work that
    drafting every step would have spread over the paused steps, so the governor's probe does not pay for it."""
    _, prompts = trained
    engine = eagle_paused_for_8_steps(tiny_llama, trained_eagle)
    speculator = engine.runner.speculator
    joined, recorded = Observed.joined, []
    catch_up_s = 2.0  # well above a step of this tiny model, even a first drafting one on a loaded machine
    monkeypatch.setattr(Observed, "joined", classmethod(lambda cls, items: time.sleep(catch_up_s) or joined(items)))
    record = speculator.governor.record
    monkeypatch.setattr(speculator.governor, "record", lambda *args: recorded.append(args) or record(*args))
    engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    resumed = next(index for index, (_, drafted, _, _) in enumerate(recorded) if index > 3 and drafted)
    assert [drafted for _, drafted, _, _ in recorded[resumed - 8 : resumed]] == [False] * 8
    assert all(seconds < catch_up_s for *_, seconds in recorded), recorded


def test_a_step_is_charged_for_drafting_the_trees_it_verifies_not_the_next_ones(tiny_llama, trained, monkeypatch):
    """Drafting happens at the end of a step, for the next one: counted in the step that drafts, a slow draft would
    make plain steps that start drafting look slow and drafted steps that stop drafting look fast."""
    draft, prompts = trained
    engine = build(tiny_llama, speculative=draft, adaptive_speculation=True)
    speculator = engine.runner.speculator
    propose, recorded = speculator.proposer.propose, []

    def slow_propose(observed, drafting):
        if drafting:
            time.sleep(0.2)
        return propose(observed, drafting)

    monkeypatch.setattr(speculator.proposer, "propose", slow_propose)
    record = speculator.governor.record

    def logged_record(num_seqs, drafted, num_tokens, seconds):
        recorded.append((drafted, seconds))
        record(num_seqs, drafted, num_tokens, seconds)

    monkeypatch.setattr(speculator.governor, "record", logged_record)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert {drafted for drafted, _ in recorded} == {True, False}
    assert all((seconds >= 0.2) == drafted for drafted, seconds in recorded), recorded


def test_governor_measures_drafting_by_its_decision_even_when_an_unsure_draft_proposes_nothing(tiny_llama, trained_eagle):
    """Drafting with a confidence threshold the draft never reaches only costs: those steps count as drafted, so the
    governor measures that and stops; counted as plain by their empty trees, drafting would never be measured."""
    engine = build(tiny_llama, speculative=trained_eagle, adaptive_speculation=True, speculative_min_confidence=0.99)
    proposer = engine.runner.speculator.proposer
    propose = proposer.propose
    # a draft's cost well above the timing noise of a loaded machine, as a draft's is on a real model
    proposer.propose = lambda observed, drafting: (time.sleep(0.05) if drafting else None) or propose(observed, drafting)
    decisions = []
    should_draft = engine.runner.speculator.governor.should_draft
    engine.runner.speculator.governor.should_draft = lambda num_seqs: decisions.append(should_draft(num_seqs)) or decisions[-1]
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert engine.runner.speculator.stats.num_draft_tokens == 0
    assert {(1, True), (1, False)} <= set(engine.runner.speculator.governor.step_seconds)
    assert decisions.count(True) < len(decisions) / 2


def test_observations_join_into_one_run_of_positions():
    def seen(first: int, rows: list[float], tokens: list[int]) -> Observed:
        return Observed(None, first, torch.tensor(rows)[:, None], tokens, True)

    joined = Observed.joined([seen(4, [4.0], [5, 9]), seen(5, [5.0, 6.0], [6, 7]), seen(6, [6.5], [8])])
    assert joined.first_position == 4 and joined.features.flatten().tolist() == [4.0, 5.0, 6.5] and joined.next_token_ids == [5, 6, 8]
    past_a_gap = Observed.joined([seen(4, [4.0], [5]), seen(9, [9.0], [10])])
    assert past_a_gap.first_position == 9 and past_a_gap.features.flatten().tolist() == [9.0] and past_a_gap.next_token_ids == [10]


def test_eagle_takes_the_pairs_of_undrafted_steps_when_drafting_resumes(tiny_llama, trained, trained_eagle):
    """Drafting pauses (the governor's choice, or load) cost nothing and leave no hole in the draft's context."""
    _, prompts = trained
    engine = eagle_paused_for_8_steps(tiny_llama, trained_eagle)
    speculator = engine.runner.speculator
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seq = engine.add_request(prompts[0], params)
    for _ in range(11):
        engine.step()
    proposer = speculator.proposer
    assert len(proposer.pending[seq]) == 8  # paused: the pairs wait
    engine.step()
    assert seq not in proposer.pending and proposer.caches[seq].next_position == seq.num_computed_tokens
    assert proposer.caches[seq].keys.shape[1] == seq.num_computed_tokens  # every position, none twice
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == build(tiny_llama).generate([prompts[0]], params)[0]["token_ids"]


def test_adaptive_speculation_stops_drafting_when_verifying_costs_more_than_it_returns(tiny_llama, trained, monkeypatch):
    draft, prompts = trained
    engine = build(tiny_llama, speculative=draft, adaptive_speculation=True)
    plain = build(tiny_llama).generate(prompts[:1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    governor = engine.runner.speculator.governor
    record = governor.record

    def slow_drafts(num_seqs, drafted, num_tokens, seconds):
        return record(num_seqs, drafted, num_tokens, seconds * (50 if drafted else 1))

    monkeypatch.setattr(governor, "record", slow_drafts)
    served = engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert served[0]["token_ids"] == plain[0]["token_ids"]
    stats = engine.runner.speculator.stats
    # the first tries (a step's rate is recorded after it has decided the next step's drafts), then only probes
    assert 1 <= stats.num_drafts <= 2 + 40 // governor.probe_every


@pytest.mark.parametrize("method", ["medusa", "eagle tree"])
def test_sampled_speculative_decoding_is_reproducible_with_a_seed(tiny_llama, trained, trained_eagle, method):
    """Rejection sampling draws as many numbers as the drafts ask for, so a seed reproduces the output when the
    drafts are the same: EAGLE's depend on the features it saw, and a prefix-cache hit hides the prompt's."""
    draft, prompts = trained
    engine = build(tiny_llama, speculative=draft) if method == "medusa" else build(
        tiny_llama, speculative=trained_eagle, num_speculative_tokens=3, speculative_tree_nodes=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=3, logprobs=2)
    first, second = engine.generate(prompts[:1], params), engine.generate(prompts[:1], params)
    assert first[0]["token_ids"] == second[0]["token_ids"] and len(first[0]["token_ids"]) == 16
    assert len(first[0]["logprobs"]) == 16 and engine.runner.speculator.stats.num_drafts > 0


def test_greedy_accept_follows_the_targets_choices_down_the_tree():
    chain = DraftTree.chain([5, 6, 9])
    assert greedy_accept([5, 6, 7, 8], chain) == [0, 1]
    assert greedy_accept([5, 6, 9, 8], chain) == [0, 1, 2]
    assert greedy_accept([5], DraftTree()) == []
    tree = DraftTree([4, 5, 7, 6], [-1, -1, 0, 1])  # 4 -> 7 and 5 -> 6
    assert greedy_accept([5, 7, 6, 0, 1], tree) == [1, 3]
    assert tree.depths == [1, 1, 2, 2] and tree.path(3) == [1, 3]


@pytest.mark.parametrize("tree", [DraftTree.chain([0, 1]), DraftTree([2, 0, 1, 3], [-1, -1, 0, 1])], ids=["chain", "tree"])
def test_rejection_sampling_follows_the_target_distribution(tree):
    """Whatever the drafts, the first token follows the target's row 0 and, given the first, the second follows the
    row of the node that holds the first (or row 0's distribution again when no node does: not tested here)."""
    generator = torch.Generator().manual_seed(0)
    vocab, num_draws = 6, 8000
    target = (torch.randn(1 + len(tree), vocab, generator=generator) * 1.5).softmax(-1)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(num_draws):
        path, last = rejection_sample(target, tree, generator)
        tokens = [tree.tokens[node] for node in path] + [last]
        first[tokens[0]] += 1
        if path and path[0] == 0:  # the second token is drawn after node 0
            second[tokens[1]] += 1
    assert chisquare(first, target[0] * num_draws).pvalue > 1e-3
    assert chisquare(second, target[1] * second.sum()).pvalue > 1e-3 and second.sum() > 100


def test_metrics_expose_acceptance(tiny_llama, trained):
    from llmc.runtime.serving.prometheus import EngineCollector

    draft, prompts = trained
    engine = build(tiny_llama, speculative=draft)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    families = {family.name: family for family in EngineCollector(engine.stats).collect()}
    stats = engine.runner.speculator.stats
    assert families["llmc:spec_decode_num_accepted_tokens"].samples[0].value == stats.num_accepted_tokens > 0
    per_position = families["llmc:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [sample.value for sample in per_position] == stats.accepted_per_position
    assert families["llmc:spec_decode_mean_accepted_length"].samples[0].value == stats.mean_accepted_length
