"""The data file a resume compares: its size, its record count and the SHA-256 of all its bytes.

The hash is made while the file is indexed (that pass reads every byte anyway); checkpoints written
before it carry only a hash of 64 evenly spaced records, and still resume, comparing what they have.
"""

from __future__ import annotations

import hashlib

import pytest

from conftest import REPO, resume_file, run_args, slice_jsonl, train
from dataset.jsonl_file import UTF8_BOM, JsonlFile
from trainer.hardening.resume_checks import ResumeMismatch, check_resume_compatible, data_fingerprint

RECORDS = 200  # more than the 64 sampled records, so some are not sampled


def test_the_index_hash_is_the_sha256_of_the_files_bytes_a_bom_included(tmp_path):
    path = slice_jsonl(REPO / "dataset" / "pretrain_demo.jsonl", tmp_path / "data.jsonl", RECORDS)
    with_bom = tmp_path / "bom.jsonl"
    with_bom.write_bytes(UTF8_BOM + path.read_bytes())
    for file in (path, with_bom):
        assert JsonlFile(file).sha256 == hashlib.sha256(file.read_bytes()).hexdigest()


def test_resume_refuses_a_same_length_edit_of_a_record_the_sample_does_not_cover(tmp_path):
    data = slice_jsonl(REPO / "dataset" / "pretrain_demo.jsonl", tmp_path / "data.jsonl", RECORDS)
    args = run_args(tmp_path, data, "--batch_size", "4", "--max_steps", "1")
    train("train_pretrain.py", None, args, tmp_path)
    lines = data.read_text(encoding="utf-8").splitlines(keepends=True)
    sampled = {(k * RECORDS) // 64 for k in range(64)}
    unsampled = next(i for i in range(RECORDS) if i not in sampled)
    line = lines[unsampled]
    # One vowel of the text for another: the same bytes, other data.
    at = next(i for i in range(line.index('": "') + 4, len(line)) if line[i] in "aeiou")
    lines[unsampled] = line[:at] + ("e" if line[at] == "a" else "a") + line[at + 1:]
    before = data.stat().st_size
    data.write_text("".join(lines), encoding="utf-8")
    assert data.stat().st_size == before

    result = train("train_pretrain.py", None, [*args, "--from_resume", "1"], tmp_path, check=False)
    assert result.returncode == 2 and "cannot resume" in result.stderr, result.stderr
    assert "data.sha256: checkpoint has" in result.stderr and "data.sample_sha256" not in result.stderr
    assert resume_file(tmp_path)["global_step"] == 1  # nothing trained after the refusal


def test_a_checkpoint_without_the_whole_file_hash_compares_what_it_has_and_says_so(tmp_path):
    data = slice_jsonl(REPO / "dataset" / "pretrain_demo.jsonl", tmp_path / "data.jsonl", RECORDS)
    fingerprint = data_fingerprint(JsonlFile(data))
    settings = {"batch_size": 4, "accumulation_steps": 1, "global_batch_size": None, "world_size": 1}
    earlier = {k: v for k, v in fingerprint.items() if k != "sha256"}  # as an earlier version wrote it
    saved = {"lm_config": {"hidden_size": 32}, "data_fingerprint": earlier, "train_args": settings}
    notes = check_resume_compatible(saved, {"hidden_size": 32}, fingerprint, settings)
    assert len(notes) == 1 and "no hash of the whole data file" in notes[0]
    with pytest.raises(ResumeMismatch, match="data.sample_sha256"):
        check_resume_compatible({**saved, "data_fingerprint": {**earlier, "sample_sha256": "0" * 64}},
                                {"hidden_size": 32}, fingerprint, settings)


def test_a_resume_with_another_tokenizer_is_refused_and_a_checkpoint_without_its_record_says_so():
    """The same data file read by another tokenizer of the same size is other ids: the vocab hash is compared."""
    settings = {"batch_size": 4, "accumulation_steps": 1, "global_batch_size": None, "world_size": 1,
                "tokenizer_vocab_sha256": "a" * 64}
    saved = {"lm_config": {"hidden_size": 32}, "data_fingerprint": {"sha256": "x"}, "train_args": settings}
    assert check_resume_compatible(saved, {"hidden_size": 32}, {"sha256": "x"}, settings) == []
    with pytest.raises(ResumeMismatch, match="args.tokenizer_vocab_sha256: checkpoint has 'aaaa"):
        check_resume_compatible(saved, {"hidden_size": 32}, {"sha256": "x"},
                                {**settings, "tokenizer_vocab_sha256": "b" * 64})
    earlier = {**saved, "train_args": {k: v for k, v in settings.items() if k != "tokenizer_vocab_sha256"}}
    notes = check_resume_compatible(earlier, {"hidden_size": 32}, {"sha256": "x"}, settings)
    assert len(notes) == 1 and "no record of its tokenizer" in notes[0]
