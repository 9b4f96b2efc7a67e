import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from helpers import CORPUS, write_recipe
from transformers import AutoConfig

from llmc.cli import cli
from llmc.core.errors import LlmcError
from llmc.draft.build import medusa_rows, medusa_top1, train_draft, train_eagle
from llmc.draft.config import DraftConfig
from llmc.draft.data import DistillSet, cached_self_distill, distill_cache_path, load_distill_set, save_distill_set
from llmc.draft.labels import OUT_OF_VOCAB
from llmc.draft.losses import TOKEN_LOSS_WEIGHT, eagle_loss, medusa_labels, medusa_loss, unrolled
from llmc.draft.train import CHECKPOINT, TrainConfig, train
from llmc.draft.vocabulary import held_out_split, most_frequent_tokens
from llmc.pipeline.inspect_artifact import describe_artifact
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.speculative.eagle import EagleDraft, EagleShape
from llmc.runtime.speculative.medusa import MedusaHeads

CORPUS_WORDS = CORPUS.split()
STAGE = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"


def test_medusa_heads_start_as_the_lm_head_over_the_draft_vocabulary():
    lm_head, vocab = torch.randn(16, 8), torch.tensor([2, 5, 11])
    heads = MedusaHeads.from_lm_head(lm_head, vocab, 3)
    hidden = torch.randn(5, 8)
    assert torch.equal(heads(hidden), (hidden @ lm_head[vocab].T).expand(3, 5, 3))
    assert heads.vocab.tolist() == [2, 5, 11] and torch.equal(heads(hidden, 2), heads(hidden)[:2])
    assert medusa_labels([10, 11, 12, 13, 14], 1, 2).tolist() == [[13, 14], [14, -100], [-100, -100]]


def test_medusa_rows_map_labels_into_the_draft_vocabulary_and_top1_counts_unknown_tokens_as_missed():
    to_vocab = torch.full((16,), OUT_OF_VOCAB)
    to_vocab[torch.tensor([3, 4, 5])] = torch.tensor([0, 1, 2])
    hidden = torch.arange(5.0)[:, None].expand(5, 8)  # one per token but the last
    rows, labels = medusa_rows([([1, 2, 3, 9, 5, 4], hidden, 2)], to_vocab, 2)
    assert torch.equal(rows, hidden[1:]) and labels.tolist() == [[OUT_OF_VOCAB, 2], [2, 1], [1, -100], [-100, -100]]
    heads = MedusaHeads(8, 2, 3)
    with torch.no_grad():
        for projection in heads.projections:
            projection.weight.copy_(torch.tensor([[1.0] * 8, [0.0] * 8, [-1.0] * 8]))  # always guesses index 0
    labels[:, 0] = torch.tensor([0, 0, 1, 0])
    assert medusa_top1(heads, rows, labels) == [0.75, 0.0]
    assert medusa_loss(heads, rows, labels).isfinite()  # unknown tokens and ends carry no loss


def test_one_answer_in_25_is_held_out_of_training():
    training, held_out = held_out_split(list(range(60)))
    assert held_out == [0, 25, 50] and training == [i for i in range(60) if i not in (0, 25, 50)]
    assert held_out_split([7]) == ([7], [])


def test_training_resumes_from_its_checkpoint(tmp_path):
    torch.manual_seed(0)
    hidden, labels, lm_head = torch.randn(64, 8), torch.randint(0, 16, (64, 2)), torch.randn(16, 8)

    def run(heads, fail_at=None):
        def loss_fn(step):
            if step == fail_at:
                raise KeyboardInterrupt
            return medusa_loss(heads, hidden, labels)
        return train(heads, loss_fn, TrainConfig(steps=12, lr=1e-2, checkpoint_every=4), tmp_path, "test")

    straight = run(MedusaHeads.from_lm_head(lm_head, torch.arange(16), 2))
    with pytest.raises(KeyboardInterrupt):
        run(MedusaHeads.from_lm_head(lm_head, torch.arange(16), 2), fail_at=10)
    assert (tmp_path / CHECKPOINT).is_file()
    resumed = run(MedusaHeads.from_lm_head(lm_head, torch.arange(16), 2))
    assert len(resumed) == 12 and resumed == pytest.approx(straight, rel=1e-5)
    assert straight[-1] < straight[0]
    assert (tmp_path / "loss.png").is_file() and not (tmp_path / CHECKPOINT).exists()


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_recipe_draft_trains_heads_into_the_artifact(tmp_path, tiny_llama, calib_file, monkeypatch, method):
    monkeypatch.setenv("LLMC_HOME", str(tmp_path / "home"))  # the distillation cache
    more_prompts = tmp_path / "more.jsonl"
    more_prompts.write_text('{"prompt": "Name three rivers."}\n{"prompt": "Why is the sky blue?"}\n')
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", STAGE, calib_file)
    recipe.write_text(recipe.read_text() + f"draft:\n  method: {method}\n  prompts: [{calib_file}, {more_prompts}]\n"
                      "  num_prompts: 6\n  max_tokens: 24\n  num_heads: 2\n  steps: 30\n  batch_size: 32\n")
    artifact = run_quantize(load_recipe(recipe, ["calibration.num_samples=2"]))
    written = {"config.json", "heads.safetensors", "loss.png"} | ({"vllm"} if method == "eagle3" else set())
    assert {path.name for path in (artifact / "draft").iterdir()} == written
    info = describe_artifact(artifact)
    acceptance = info["draft"]["heldout_acceptance"]  # measured on the held-out answers' prompts, a chain of 3
    assert acceptance["num_prompts"] == 1 and acceptance["chain"] == 3 and 1 <= acceptance["mean_accepted_length"] <= 4
    assert info["draft"]["method"] == method and info["draft"]["trained_on"]["num_answers"] == 4 + 2  # distinct prompts
    assert "draft/heads.safetensors" in info["manifest"]["files"]
    listed = " ".join(CliRunner().invoke(cli, ["inspect", str(artifact)]).output.split())
    if method == "medusa":  # EAGLE's windows take the longest answers only: too few of these six to hold one out
        held_out = info["draft"]["train"]["heldout_top1_per_head"]
        assert info["draft"]["trained_on"]["num_held_out"] == 1 and len(held_out) == 2
        assert f"held out {', '.join(f'{value:.2f}' for value in held_out)}" in listed
    histogram = tmp_path / "accepted.png"
    run = CliRunner().invoke(cli, ["eval", str(artifact), "--speculative", "auto", "--prompts", str(calib_file), "--num-prompts", "2",
                                   "--max-tokens", "12", "--concurrency", "2", "--histogram", str(histogram), "--json",
                                   "--speculative-tree-nodes", "4", "--speculative-min-confidence", "0.05"])
    assert run.exit_code == 0, run.output
    result = json.loads(run.stdout)
    assert result["num_prompts"] == 2 and result["mean_accepted_length"] >= result["tokens_per_step"] >= 1 and histogram.is_file()
    assert {"batch1", "concurrency2", "acceptance_per_position"} <= set(result)
    assert result["identical_outputs"] == 2 and {"speedup", "served_speedup"} <= set(result["concurrency2"])
    assert result["concurrency2"]["rounds"] == 3
    aux_layers = tuple(info["draft"].get("aux_layer_ids", ()))  # EAGLE-3's sets hold those layers' features too
    cached_self_distill(artifact, calib_file, 6, 24, aux_layers=aux_layers)  # the heads in the artifact do not change the key
    cached_self_distill(artifact, more_prompts, 6, 24, aux_layers=aux_layers)
    assert len(list((tmp_path / "home" / "distill").glob("*.safetensors"))) == 2  # one per prompt file


def test_draft_vocabulary_is_the_answers_most_frequent_tokens():
    answers = [torch.tensor([7, 7, 3, 9]), torch.tensor([3, 7, 5, 5, 2])]
    assert most_frequent_tokens(answers, 12, 3).tolist() == [3, 5, 7]  # counts 7: 3, 3: 2, 5: 2, then 2 and 9: 1
    assert most_frequent_tokens(answers, 12, 100).tolist() == [2, 3, 5, 7, 9]  # never a token no answer uses


def test_eagle_learns_only_the_feature_of_a_token_outside_its_vocabulary():
    torch.manual_seed(0)
    shape = EagleShape(hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32, rope_theta=10000.0, rms_norm_eps=1e-6,
                       draft_vocab_size=10)
    draft, lm_head = EagleDraft(shape), torch.randn(10, 16)
    features, embeddings, positions = torch.randn(1, 5, 16), torch.randn(1, 4, 16), torch.arange(4)[None]
    labels = torch.tensor([[-100, 3, OUT_OF_VOCAB, 6]])
    predicted = unrolled(draft, features[:, :4], embeddings, positions, 1)[0]
    answer = torch.tensor([False, True, True, True])
    expected = F.smooth_l1_loss(predicted[0, answer], features[0, 1:][answer])
    expected = expected + TOKEN_LOSS_WEIGHT * F.cross_entropy(predicted[0, [1, 3]] @ lm_head.T, torch.tensor([3, 6]))
    assert torch.allclose(eagle_loss(draft, features, embeddings, positions, labels, lm_head, 0.0, unroll=1), expected)


def test_distillation_set_round_trips_through_safetensors(tmp_path):
    hidden = [torch.randn(4, 8).bfloat16().float(), torch.randn(2, 8).bfloat16().float()]
    data = DistillSet([[1, 2, 3, 4, 5], [6, 7, 8]], hidden, [2, 1], torch.randn(16, 8).bfloat16().float().T.contiguous().T)
    save_distill_set(data, tmp_path / "set.safetensors")
    loaded = load_distill_set(tmp_path / "set.safetensors")
    assert loaded.token_ids == data.token_ids and loaded.answer_starts == data.answer_starts
    assert all(torch.equal(a, b) for a, b in zip(loaded.hidden, data.hidden)) and torch.equal(loaded.lm_head, data.lm_head)


def test_an_interrupted_distillation_resumes_from_the_answers_it_saved(tmp_path, tiny_llama, monkeypatch):
    import llmc.draft.data as distill
    from llmc.runtime.llm import LLM

    monkeypatch.setenv("LLMC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(distill, "DISTILL_PART", 3)
    monkeypatch.setattr(distill, "DISTILL_SEQS", 2)  # answers finish two at a time
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(CORPUS_WORDS[i : i + 4 + i % 3])}) + "\n" for i in range(0, 70, 10)))
    artifact = run_quantize(load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", STAGE)))
    saved, real_save = [], distill.save_answers

    def save_then_stop(answers, path):
        real_save(answers, path)
        saved.append(sorted(answers))
        raise KeyboardInterrupt  # as Ctrl-C after the first part

    monkeypatch.setattr(distill, "save_answers", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        cached_self_distill(artifact, prompts, None, 12)
    monkeypatch.setattr(distill, "save_answers", real_save)
    (cache,) = (tmp_path / "home" / "distill").iterdir()
    assert cache.suffix == ".parts" and [path.name for path in cache.iterdir()] == ["part-0000.safetensors"]
    requested = []
    monkeypatch.setattr(
        LLM, "add_request", lambda self, *args, _add=LLM.add_request: requested.append(args[0]) or _add(self, *args)
    )
    resumed = cached_self_distill(artifact, prompts, None, 12)
    assert saved == [[0, 1, 2, 3]] and len(requested) == 3  # only the answers not saved are generated
    assert [path.suffix for path in (tmp_path / "home" / "distill").iterdir()] == [".safetensors"]  # parts gone once whole
    straight = distill.self_distill(artifact, prompts, 7, 12, tmp_path / "fresh")
    assert resumed.token_ids == straight.token_ids and resumed.answer_starts == straight.answer_starts
    for kept, fresh in zip(resumed.hidden, straight.hidden):  # saved answers come back in bfloat16
        torch.testing.assert_close(kept, fresh, rtol=1e-2, atol=1e-2)
    requested.clear()
    assert cached_self_distill(artifact, prompts, None, 12).token_ids == straight.token_ids and not requested


def test_eagle_draft_learns_to_predict_the_next_feature(tmp_path):
    torch.manual_seed(0)
    shape = EagleShape(hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32, rope_theta=10000.0, rms_norm_eps=1e-6,
                       draft_vocab_size=10)
    features = torch.randn(2, 14, 16)
    embeddings, positions = torch.randn(2, 13, 16), torch.arange(12).expand(2, 12)
    labels, lm_head = torch.randint(0, 10, (2, 13)), torch.randn(10, 16)
    draft = EagleDraft(shape)
    losses = train(draft, lambda step: eagle_loss(draft, features, embeddings, positions, labels, lm_head, 1.0, unroll=2),
                   TrainConfig(steps=60, lr=1e-2), tmp_path, "eagle")
    assert losses[-1] < 0.5 * losses[0]
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    features, embedded = features[:, :12], embeddings[:, :12]
    full, _, _ = draft(features, embedded, positions, causal)
    first, keys, values = draft(features[:, :5], embedded[:, :5], positions[:, :5], causal[:5, :5])
    rest, _, _ = draft(features[:, 5:], embedded[:, 5:], positions[:, 5:], causal[5:], (keys, values))
    assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-5)  # incremental with cached keys = all at once
    one_step, two_steps = unrolled(draft, features, embeddings, positions, unroll=2)
    assert torch.allclose(one_step, full, atol=1e-5)
    for row in (0, 6, 11):  # step 2 = drafting after the true pairs up to row: its guess fed back at the next position
        _, keys, values = draft(features[:, : row + 1], embeddings[:, : row + 1], positions[:, : row + 1], causal[: row + 1, : row + 1])
        fed_back = full[:, row : row + 1]
        drafted, _, _ = draft(fed_back, embeddings[:, row + 1 : row + 2], positions[:, row : row + 1] + 1,
                              torch.ones(1, row + 2, dtype=torch.bool), (keys, values))
        assert torch.allclose(drafted[:, 0], two_steps[:, row], atol=1e-5)


def test_train_draft_needs_an_artifact_and_valid_settings(tmp_path):
    with pytest.raises(LlmcError, match="not an llmc artifact"):
        train_draft(tmp_path, DraftConfig())
    run = CliRunner().invoke(cli, ["train-draft", str(tmp_path), "--set", "steps=0"], standalone_mode=False)
    assert isinstance(run.exception, LlmcError) and "draft.steps" in str(run.exception)


def test_stored_features_that_would_not_fit_are_refused_before_distilling(tmp_path, tiny_llama, calib_file, monkeypatch):
    import llmc.draft.features as features

    monkeypatch.setenv("LLMC_HOME", str(tmp_path / "home"))
    artifact = run_quantize(load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", STAGE)))
    config = DraftConfig(method="eagle3", prompts=[str(calib_file)], num_prompts=6, max_tokens=24, steps=1)
    disk, memory = features.stored_feature_bytes(artifact, config, [0, 1, 2])
    monkeypatch.setattr(features, "available_host_bytes", lambda: memory - 1)
    with pytest.raises(LlmcError, match=r"GiB of memory in training \(.*\); read them online instead \(draft.features: online"):
        train_draft(artifact, config)
    assert not (tmp_path / "home" / "distill").exists()  # refused before any work
    cached_self_distill(artifact, calib_file, 6, 24, aux_layers=(0, 1, 2))
    stored = distill_cache_path(artifact, calib_file, 6, 24, (0, 1, 2)).stat().st_size
    assert 0.8 * disk / 2 < stored <= disk / 2  # one set, counted twice; a whole answer for each prompt
    cached_disk, cached_memory = features.stored_feature_bytes(artifact, config, [0, 1, 2])
    assert cached_disk == 0 and 0.8 * memory < cached_memory <= memory  # now the set's own size
    assert features.stored_feature_bytes(tiny_llama, config, [0, 1, 2])[0] == 0  # a model folder: memory alone


def test_mt_bench_is_refused_as_training_prompts(tmp_path):
    from llmc.core.prompts import check_not_eval_set

    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Compose a blog post."]}) + "\n")
    with pytest.raises(LlmcError, match="evaluation set"):
        check_not_eval_set(path)


def test_eagle_top1_on_held_out_answers_is_measured_on_answers_it_never_trained_on(tmp_path, tiny_llama):
    """Training answers count up one token at a time, the held-out ones (every 25th) are random: the draft learns to
    count, which its training top-1 shows and its held-out top-1 must not."""
    hf = AutoConfig.from_pretrained(tiny_llama)
    generator = torch.Generator().manual_seed(0)

    def counting(start):
        return [(start + k) % hf.vocab_size for k in range(40)]

    token_ids = [torch.randint(hf.vocab_size, (40,), generator=generator).tolist() if index % 25 == 0 else counting(index)
                 for index in range(50)]
    data = DistillSet(token_ids, [torch.randn(39, hf.hidden_size, generator=generator) for _ in token_ids], [4] * 50,
                      torch.randn(hf.vocab_size, hf.hidden_size, generator=generator))
    summary = train_eagle(data, DraftConfig(method="eagle", steps=150, batch_size=64, lr=3e-3), tmp_path, tiny_llama)
    assert summary["trained_on"]["num_held_out"] == 2
    train_top1, held_out_top1 = summary["train"]["train_top1_per_step"], summary["train"]["heldout_top1_per_step"]
    assert min(train_top1) >= 0.4 and max(held_out_top1) <= 0.1, (train_top1, held_out_top1)  # chance: 1 / vocab


def test_medusa_heads_of_an_earlier_llmc_are_refused_with_a_way_out(tmp_path):
    from llmc.runtime.speculative.store import load_draft, save_draft

    save_draft(tmp_path, {"method": "medusa", "num_heads": 4, "hidden_size": 576})  # no draft vocabulary: frozen-head era
    with pytest.raises(LlmcError, match="earlier llmc.*retrain them with `llmc train-draft`"):
        load_draft(tmp_path, torch.float32, "cpu")
