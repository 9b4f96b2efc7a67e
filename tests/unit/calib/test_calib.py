import json

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from llmc.calib.data import CalibrationConfig, load_calibration
from llmc.core.errors import LlmcError


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_jsonl_samples_shape_seed_and_hash(calib_file, tokenizer):
    config = CalibrationConfig(dataset=str(calib_file), num_samples=4, seq_len=32, seed=1)
    first = load_calibration(config, tokenizer)
    assert first.input_ids.shape == (4, 32)
    assert first.sha256 == load_calibration(config, tokenizer).sha256
    other = load_calibration(config.model_copy(update={"seed": 2}), tokenizer)
    assert other.sha256 != first.sha256


def test_txt_and_parquet(tmp_path, calib_file, tokenizer):
    records = [json.loads(line) for line in calib_file.read_text().splitlines()]
    txt = tmp_path / "c.txt"
    txt.write_text("\n".join(r["text"] for r in records))
    parquet = tmp_path / "c.parquet"
    pd.DataFrame({"body": [r["text"] for r in records]}).to_parquet(parquet)
    assert load_calibration(CalibrationConfig(dataset=str(txt), num_samples=2, seq_len=16), tokenizer).input_ids.shape == (2, 16)
    config = CalibrationConfig(dataset=str(parquet), text_field="body", num_samples=2, seq_len=16)
    assert load_calibration(config, tokenizer).input_ids.shape == (2, 16)


def test_chat_template_renders_messages(calib_file, tokenizer):
    plain = load_calibration(CalibrationConfig(dataset=str(calib_file), num_samples=1, seq_len=8, seed=0), tokenizer)
    chat = load_calibration(
        CalibrationConfig(dataset=str(calib_file), num_samples=1, seq_len=8, seed=0, chat_template=True), tokenizer
    )
    assert tokenizer.decode(chat.input_ids[0]).startswith("<user>")
    assert not torch.equal(plain.input_ids, chat.input_ids)


def test_errors(tmp_path, calib_file, tokenizer):
    with pytest.raises(LlmcError, match="calibration file not found"):
        load_calibration(CalibrationConfig(dataset=str(tmp_path / "none.jsonl")), tokenizer)
    with pytest.raises(LlmcError, match="no field 'body'"):
        load_calibration(CalibrationConfig(dataset=str(calib_file), text_field="body"), tokenizer)
    with pytest.raises(LlmcError, match="fewer than num_samples x seq_len"):
        load_calibration(CalibrationConfig(dataset=str(calib_file), num_samples=1000, seq_len=512), tokenizer)
