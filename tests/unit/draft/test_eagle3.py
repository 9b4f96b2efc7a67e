import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import llmc_in_process, write_recipe
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from llmc.core.errors import LlmcError
from llmc.draft.build import eagle3_aux_layers, save_eagle3
from llmc.draft.config import DraftConfig
from llmc.draft.data import distill_engine, load_distill_set, save_distill_set, self_distill
from llmc.draft.eagle3 import train_eagle3
from llmc.draft.features import OnlineFeatures, StoredFeatures, feature_mode
from llmc.draft.labels import NOT_LEARNED
from llmc.draft.losses import eagle3_loss, unrolled
from llmc.draft.sequences import SequenceBatch, padded_batch, sequence_rows
from llmc.draft.vllm_export import VLLM_DIR, export_for_vllm
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.speculative.eagle3 import ARCHITECTURE, Eagle3Draft, default_aux_layers, eagle3_config
from llmc.runtime.speculative.store import load_draft

AUX_LAYERS = (0, 1, 2)  # the tiny model's two layers: the embeddings, between the layers, the last layer's output


@pytest.fixture(scope="module")
def distilled_aux(tmp_path_factory, tiny_llama, calib_file):
    return self_distill(tiny_llama, calib_file, 6, 24, tmp_path_factory.mktemp("parts"), aux_layers=AUX_LAYERS)


@pytest.fixture(scope="module")
def eagle3_folder(tmp_path_factory, tiny_llama, distilled_aux) -> Path:
    folder = tmp_path_factory.mktemp("eagle3")
    config = DraftConfig(method="eagle3", steps=150, batch_size=64, lr=3e-3)
    save_eagle3(distilled_aux, "stored", config, list(AUX_LAYERS), folder, tiny_llama)
    return folder


def test_default_aux_layers_are_low_middle_and_high():
    assert default_aux_layers(32) == [2, 16, 29]  # Llama-3.1-8B: vLLM's and EAGLE-3's choice
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_aux_layers(2) == [0, 1, 2]


def test_kept_aux_features_are_transformers_hidden_states_entering_those_layers(tiny_llama, distilled_aux):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids, aux = distilled_aux.token_ids[0], distilled_aux.aux[0]
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [0]: embeddings; the last is normed
    hidden = model.config.hidden_size
    assert aux.dtype == torch.bfloat16 and aux.shape == (len(ids) - 1, len(AUX_LAYERS) * hidden)
    for column, layer in enumerate(AUX_LAYERS[:-1]):
        torch.testing.assert_close(aux[:, column * hidden : (column + 1) * hidden].float(), states[layer][0, :-1], rtol=1e-2, atol=1e-2)
    last = model.model.norm(aux[:, -hidden:].float())  # the last layer's output, before the final norm
    torch.testing.assert_close(last, states[-1][0, :-1], rtol=2e-2, atol=2e-2)


def test_aux_features_round_trip_through_the_distillation_cache(tmp_path, distilled_aux):
    save_distill_set(distilled_aux, tmp_path / "set.safetensors")
    loaded = load_distill_set(tmp_path / "set.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(loaded.aux, distilled_aux.aux))


def test_eagle3_loss_is_the_cross_entropy_against_the_target_distribution():
    config = eagle3_config(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                       num_hidden_layers=4, vocab_size=40), [0, 2, 4], draft_vocab_size=10)
    torch.manual_seed(0)
    draft = Eagle3Draft(config)
    lm_head = torch.randn(10, 16)
    aux, embeddings, target_hidden = torch.randn(1, 5, 48), torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    every_row = torch.arange(5)[None]
    every = torch.ones(1, 5, dtype=torch.bool)
    batch = SequenceBatch(aux, embeddings, every_row, target_hidden, torch.zeros(1, 5, dtype=torch.long), every, every_row, every)
    loss = eagle3_loss(draft, batch, lm_head, unroll=1)
    out, _, _ = draft(draft.combine(aux), embeddings, torch.arange(5)[None], torch.ones(5, 5, dtype=torch.bool).tril())
    expected = -(torch.softmax(target_hidden @ lm_head.T, -1) * draft.logits(out).log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(loss, expected)
    # a draft whose logits equal the target's reaches the target's entropy, the least possible
    assert loss > -(torch.softmax(target_hidden @ lm_head.T, -1) * torch.log_softmax(target_hidden @ lm_head.T, -1)).sum(-1).mean()


def test_whole_sequences_train_on_their_answers_and_padding_changes_no_row():
    """EAGLE-3 trains on whole sequences (prompt and answer) of different lengths, padded into one batch, the steps past
    the first drafting only the rows that reach the answer: every drafting step's output at a drafted row equals that
    of the sequence drafted alone at every row, only answer tokens are labelled, and the loss is that of drafting
    every row at every step."""
    config = eagle3_config(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                       num_hidden_layers=4, vocab_size=40), [0, 2, 4], draft_vocab_size=40)
    torch.manual_seed(0)
    draft, embeddings, to_vocab, unroll = Eagle3Draft(config), torch.randn(40, 16), torch.arange(40), 3
    sequences = []
    for length, answer_start in [(9, 4), (14, 8)]:
        ids = torch.randint(40, (length,))
        rows = sequence_rows(ids, answer_start, torch.randn(length, 16), torch.randn(length, 48), embeddings, to_vocab, unroll)
        assert [len(part) for part in rows[:4]] == [length - unroll - 1] + [length - 2] * 3
        labels, deep_rows = rows[-2:]  # row t at step s guesses token t + s + 2
        assert (labels[: answer_start - 2] == NOT_LEARNED).all() and torch.equal(labels[answer_start - 2 :], ids[answer_start:])
        # the deeper steps start at the first row whose last step guesses an answer token
        assert torch.equal(deep_rows, torch.arange(max(0, answer_start - unroll - 1), length - unroll - 1))
        sequences.append(rows)
    batch = padded_batch(sequences)
    assert batch.aux.shape[:2] == (2, 10) and (batch.labels[0, 7:] == NOT_LEARNED).all()
    assert batch.deep_rows.shape == (2, 6) and batch.deep_real.tolist() == [[True] * 5 + [False], [True] * 6]
    # the padding rows' shifted labels would be the first sequence's last tokens: none is learned at any step
    assert all((batch.step_labels(step)[0, 5:] == NOT_LEARNED).all() for step in range(unroll))
    with torch.no_grad():
        together = unrolled(draft, draft.combine(batch.aux), batch.embedded, batch.positions, unroll, batch.deep_rows)
        for index, (aux_one, embedded_one, _, _, deep_one) in enumerate(sequences):
            alone = unrolled(draft, draft.combine(aux_one[None]), embedded_one[None], torch.arange(len(aux_one))[None], unroll)
            torch.testing.assert_close(together[0][index, : len(aux_one)], alone[0][0])
            for step in range(1, unroll):
                torch.testing.assert_close(together[step][index, : len(deep_one)], alone[step][0, deep_one])
        lm_head = torch.randn(40, 16)
        every_row = replace(batch, deep_rows=batch.positions, deep_real=batch.real_rows)
        torch.testing.assert_close(eagle3_loss(draft, batch, lm_head, unroll), eagle3_loss(draft, every_row, lm_head, unroll))


@pytest.mark.parametrize("tree_nodes", [0, 6], ids=["chain", "tree"])
@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(1, 512), (4, 7)])
def test_eagle3_greedy_output_equals_plain_decoding(tiny_llama, distilled_aux, eagle3_folder, tree_nodes, max_num_seqs,
                                                    max_num_batched_tokens):
    prompts = [ids[:start] for ids, start in zip(distilled_aux.token_ids, distilled_aux.answer_starts)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    settings = dict(dtype=torch.float32, block_size=4, num_kv_blocks=48, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens)
    plain = LLM(tiny_llama, EngineConfig(**settings)).generate(prompts, params)
    engine = LLM(tiny_llama, EngineConfig(**settings, speculative=eagle3_folder, adaptive_speculation=False,
                                                num_speculative_tokens=3, speculative_tree_nodes=tree_nodes,
                                                speculative_min_confidence=0.0))
    speculative = engine.generate(prompts, params)
    assert [out["token_ids"] for out in speculative] == [out["token_ids"] for out in plain]
    stats = engine.runner.speculator.stats
    assert stats.num_drafts > 0 and stats.mean_accepted_length > 1.2  # the draft learned the tiny model's answers


def test_eagle3_learns_from_the_fused_layers(eagle3_folder):
    config, draft = load_draft(eagle3_folder, torch.float32, "cpu")
    top1 = config["train"]["train_top1_per_step"]
    assert config["method"] == "eagle3" and config["aux_layer_ids"] == list(AUX_LAYERS) and len(top1) == 3
    assert top1[0] > 0.5  # a random draft over the vocabulary guesses ~1%
    assert torch.equal(draft.vocab[draft.t2d[draft.vocab]], draft.vocab) and int(draft.t2d.sum()) == len(draft.vocab)


def test_each_aux_layer_is_normed_on_its_own_before_fc(tiny_llama):
    """vLLM's fc_norm: one layer's features scaled (the residual stream grows with depth) fuse to the same feature."""
    torch.manual_seed(0)
    draft = Eagle3Draft(eagle3_config(AutoConfig.from_pretrained(tiny_llama), list(AUX_LAYERS), 16))
    aux = torch.randn(5, len(AUX_LAYERS) * draft.config.target_hidden_size)
    scaled = aux.clone()
    scaled[:, -draft.config.target_hidden_size :] *= 100
    assert torch.allclose(draft.combine(aux), draft.combine(scaled), atol=1e-5)
    assert not torch.allclose(draft.combine(aux), draft.combine(aux.roll(1, -1)), atol=1e-3)


def layer_outputs(draft: Eagle3Draft, features: torch.Tensor) -> torch.Tensor:
    tokens = features.shape[1]
    embeddings = torch.randn(features.shape, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    return draft(features, embeddings, torch.arange(tokens)[None], mask)[0]


def test_the_layer_reads_a_fed_back_output_at_the_scale_of_a_fused_feature(tiny_llama):
    """vLLM's norm_before_residual: the residual stream starts from the normed feature, whatever its scale."""
    torch.manual_seed(0)
    draft = Eagle3Draft(eagle3_config(AutoConfig.from_pretrained(tiny_llama), list(AUX_LAYERS), 16))
    features = torch.randn(1, 6, draft.config.hidden_size)
    assert torch.allclose(layer_outputs(draft, features), layer_outputs(draft, 30 * features), atol=1e-4)


def test_drafts_written_without_the_norms_still_load_and_read_features_as_they_are(tiny_llama):
    config = eagle3_config(AutoConfig.from_pretrained(tiny_llama), list(AUX_LAYERS), 16).to_dict()
    del config["fc_norm"], config["norm_before_residual"]  # an earlier llmc's draft config
    draft = Eagle3Draft(LlamaConfig(**config))
    aux = torch.randn(5, len(AUX_LAYERS) * draft.config.target_hidden_size)
    assert draft.fc_norm is None and torch.equal(draft.combine(aux), draft.fc(aux))
    features = torch.randn(1, 6, draft.config.hidden_size)
    assert not torch.allclose(layer_outputs(draft, features), layer_outputs(draft, 30 * features), atol=1e-1)


def test_eagle3_training_is_reproducible_from_its_seed(tiny_llama, distilled_aux):
    """The seed fixes the draft's initial weights and its training windows: the same seed, the same draft."""
    def trained_weights(seed: int, global_seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(global_seed)  # whatever the global generator holds beforehand
        config = DraftConfig(method="eagle3", steps=2, batch_size=32, seed=seed)
        draft, _ = train_eagle3(distilled_aux, StoredFeatures(distilled_aux), config, list(AUX_LAYERS), Path(tempfile.mkdtemp()),
                                tiny_llama)
        return draft.state_dict()

    first, again, other = trained_weights(0, 1), trained_weights(0, 2), trained_weights(1, 1)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["fc.weight"], other["fc.weight"])


def test_online_features_are_the_ones_the_distillation_stores(tiny_llama, distilled_aux):
    """The engine's prefill over an answer computes the features its generation kept, token by token."""
    online = OnlineFeatures(distill_engine(tiny_llama, "cpu", AUX_LAYERS), distilled_aux.token_ids)
    indices = [0, 1, 2]
    for index, (hidden, aux) in zip(indices, online(indices)):
        stored_hidden, stored_aux = distilled_aux.hidden[index], distilled_aux.aux[index]
        # the prefill also computes the last token's row, which the generation never fed back
        assert aux.dtype == torch.bfloat16 and aux.shape[0] == hidden.shape[0] == stored_hidden.shape[0] + 1
        for online_rows, stored_rows in [(aux[:-1], stored_aux), (hidden[:-1], stored_hidden)]:
            # bfloat16 where the CPU computes it (decoding and one prefill round differently): within 1%, each row
            relative = (online_rows.float() - stored_rows.float()).norm(dim=-1) / stored_rows.float().norm(dim=-1)
            assert relative.max() < 0.01


def test_eagle3_trains_online_as_on_stored_features(tiny_llama, distilled_aux):
    """The same seed, windows and features, read online instead of stored: the same training up to float rounding."""
    config = DraftConfig(method="eagle3", steps=3, batch_size=32)
    online = OnlineFeatures(distill_engine(tiny_llama, "cpu", AUX_LAYERS), distilled_aux.token_ids)
    answers_only = replace(distilled_aux, hidden=None, aux=None)
    stored, read_online = [train_eagle3(data, source, config, list(AUX_LAYERS), Path(tempfile.mkdtemp()), tiny_llama)[1]["train"]
                           for data, source in [(distilled_aux, StoredFeatures(distilled_aux)), (answers_only, online)]]
    # Adam turns rounding in a near-zero gradient into a whole step, so the losses and guesses are compared, not weights
    assert read_online["final_loss"] == pytest.approx(stored["final_loss"], rel=1e-3)
    assert read_online["train_top1_per_step"] == pytest.approx(stored["train_top1_per_step"], abs=0.02)


def test_export_writes_the_layout_vllm_loads(tmp_path, eagle3_folder):
    out = export_for_vllm(eagle3_folder, tmp_path / VLLM_DIR)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX_LAYERS)
    assert config["target_hidden_size"] == config["hidden_size"] and config["draft_vocab_size"] < config["vocab_size"]
    tensors = load_file(out / "model.safetensors")
    hidden = config["hidden_size"]
    # the names and shapes vLLM's Eagle3LlamaForCausalLM loads (midlayer. -> layers.0., q/k/v and gate/up stacked)
    assert tensors["fc.weight"].shape == (hidden, 3 * hidden)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * hidden
    assert {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
            "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
            "midlayer.self_attn.o_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(tensors)
    assert config["fc_norm"] and config["norm_before_residual"]
    assert all(tensors[f"fc_norm.{i}.weight"].shape == (hidden,) for i in range(len(AUX_LAYERS)))
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    _, draft = load_draft(eagle3_folder, torch.float32, "cpu")
    assert torch.equal(tensors["d2t"] + torch.arange(len(tensors["d2t"])), draft.vocab)  # vLLM: target id = i + d2t[i]


def test_aux_layers_are_checked_before_any_work(tiny_llama):
    with pytest.raises(LlmcError, match=r"layers are numbered 0\.\.2"):
        eagle3_aux_layers(tiny_llama, DraftConfig(method="eagle3", aux_layers=[1, 5]))
    with pytest.raises(ValueError, match="only an eagle3 draft"):
        DraftConfig(method="eagle", aux_layers=[1])
    num_layers = AutoConfig.from_pretrained(tiny_llama).num_hidden_layers
    assert eagle3_aux_layers(tiny_llama, DraftConfig(method="eagle3")) == default_aux_layers(num_layers)


def test_a_draft_that_cannot_train_is_refused_before_quantizing(tmp_path, tiny_llama, calib_file, monkeypatch):
    import llmc.draft.features as features

    class Quantizing(Exception):
        pass

    def quantize_layerwise(*args, **kwargs):
        raise Quantizing

    monkeypatch.setenv("LLMC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("llmc.pipeline.quantize.quantize_layerwise", quantize_layerwise)
    recipe = draft_gate_recipe(tmp_path, tiny_llama, calib_file, 1.0)
    with pytest.raises(LlmcError, match=r"r\.yaml line \d+: draft: .*layers are numbered 0\.\.2"):
        run_quantize(load_recipe(recipe, ["draft.aux_layers=[1,5]"]))
    monkeypatch.setattr(features, "available_host_bytes", lambda: 1000)
    with pytest.raises(LlmcError, match=r"r\.yaml line \d+: draft: .*GiB of memory in training"):
        run_quantize(load_recipe(recipe))
    assert not (tmp_path / "out").exists() and not (tmp_path / "home" / "distill").exists()
    with pytest.raises(Quantizing):  # online, nothing is stored: on to quantizing
        run_quantize(load_recipe(recipe, ["draft.features=online"]))


def test_features_are_read_online_on_a_gpu_and_stored_on_a_cpu_unless_the_recipe_says():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert [feature_mode(DraftConfig(method="eagle3"), device) for device in (cpu, gpu)] == ["stored", "online"]
    assert feature_mode(DraftConfig(method="eagle3", features="online"), cpu) == "online"
    assert feature_mode(DraftConfig(method="eagle3", features="stored"), gpu) == "stored"
    assert feature_mode(DraftConfig(method="eagle"), gpu) == "stored"  # EAGLE and Medusa read the final states alone
    with pytest.raises(ValueError, match="only an eagle3 draft reads the target's features online"):
        DraftConfig(method="medusa", features="online")


def test_eagle_and_medusa_drafts_say_why_vllm_cannot_load_them(trained):
    folder, _ = trained
    with pytest.raises(LlmcError, match="medusa draft does not export to vLLM"):
        export_for_vllm(folder, folder / VLLM_DIR)


def draft_gate_recipe(tmp_path: Path, model: Path, calib_file: Path, threshold: float) -> Path:
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "out", "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n")
    recipe.write_text(recipe.read_text() + f"draft:\n  method: eagle3\n  prompts: [{calib_file}]\n  num_prompts: 6\n  max_tokens: 24\n"
                      f"  steps: 20\n  batch_size: 32\neval:\n  gate: {{min_accepted_length: {threshold}}}\n")
    return recipe


@pytest.mark.slow
def test_the_gate_refuses_an_artifact_whose_draft_accepts_too_little(tmp_path, tiny_llama, calib_file, monkeypatch):
    monkeypatch.setenv("LLMC_HOME", str(tmp_path / "home"))
    run = llmc_in_process("quantize", str(draft_gate_recipe(tmp_path, tiny_llama, calib_file, 4.5)))
    assert run.returncode == 3, run.stderr  # a chain of 3 accepts at most 4 tokens a step
    assert "mean accepted length" in run.stderr and "< min_accepted_length 4.5" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))
    passed = llmc_in_process("quantize", str(draft_gate_recipe(tmp_path, tiny_llama, calib_file, 1.0)))
    assert passed.returncode == 0, passed.stderr
    assert (tmp_path / "out" / "draft" / "vllm" / "model.safetensors").is_file()


def test_draft_gate_and_vllm_options_are_refused_where_they_cannot_hold(tmp_path, tiny_llama, trained, eagle3_folder, calib_file):
    medusa, _ = trained
    eval_file = tmp_path / "e.txt"
    eval_file.write_text("some text " * 50)
    refusals = {
        ("--perplexity", str(eval_file), "--gate", "min_accepted_length=2"): "goes with --speculative",
        ("--perplexity", str(eval_file), "--vllm", "vllm"): "--vllm measures a draft in vLLM",
        ("--speculative", str(eagle3_folder), "--prompts", str(calib_file), "--vllm-arg=--enforce-eager"):
            "--vllm-arg --enforce-eager: only with --vllm",
        ("--speculative", str(medusa), "--prompts", str(calib_file), "--gate", "max_kl=1"): "its gate is min_accepted_length",
        ("--speculative", str(medusa), "--prompts", str(calib_file), "--vllm", sys.executable): "vLLM cannot serve",
        ("--speculative", str(medusa), "--prompts", str(calib_file), "--vllm", str(tmp_path / "nowhere")): "vLLM not found",
        ("--speculative", str(eagle3_folder), "--prompts", str(calib_file), "--vllm", sys.executable,
         "--speculative-tree-nodes", "4"): "--vllm compares chains",
    }
    for options, message in refusals.items():
        run = llmc_in_process("eval", str(tiny_llama), *options)
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, (options, run.stderr)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", "  - type: rtn\n    scheme: W4A16\n")
    recipe.write_text(recipe.read_text() + "eval:\n  gate: {min_accepted_length: 2}\n")
    run = llmc_in_process("quantize", str(recipe))
    assert run.returncode == 2 and "needs a draft section" in run.stderr
