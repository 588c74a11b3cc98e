"""Packed pretraining (`--pack 1`): texts joined as [BOS] doc [EOS] [BOS] doc [EOS] ... and cut into full
max_seq_len windows, each window one sample, so the sampler, the cursor and exact resume work unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (REPO, TINY_MODEL, assert_exit_code, assert_states_equal, child_env, events_of, free_port,
                      history_file, launch_command, resume_file, run_args, trace_of, train)
from dataset.jsonl_file import DataFileError
from dataset.lm_dataset import IGNORE_INDEX, PackedPretrainDataset
from model.tokenizer import BOS_ID, EOS_ID, load_tokenizer, text_only_copy
from trainer.hardening.resume_checks import ResumeMismatch, check_resume_compatible, resume_settings

SEQ = 48  # TINY_MODEL's --max_seq_len


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(REPO / "model" / "tokenizer.json")


def start(nproc: int | None, args: list[str], cwd: Path) -> subprocess.Popen:
    """A training invocation of TINY_MODEL, as conftest's train() runs it, started without waiting for it."""
    return subprocess.Popen(launch_command("train_pretrain.py", nproc, [*TINY_MODEL, *args]), cwd=cwd, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(job: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = job.communicate(timeout=300)
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def naive_stream(path: Path, tokenizer) -> list[int]:
    """The reference: every record tokenized on its own, wrapped in BOS/EOS, all joined in file order."""
    encoder = text_only_copy(tokenizer)
    stream = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            stream += [BOS_ID] + encoder.encode(json.loads(line)["text"]).ids + [EOS_ID]
    return stream


def test_windows_are_the_joined_documents_cut_into_max_seq_len_pieces(tmp_path, pretrain_data, tokenizer):
    stream = naive_stream(pretrain_data, tokenizer)
    dataset = PackedPretrainDataset(pretrain_data, tokenizer, SEQ)
    assert len(dataset) == len(stream) // SEQ and dataset.total_tokens == len(stream)
    for i in range(len(dataset)):
        input_ids, labels = dataset[i]
        assert input_ids.shape == labels.shape == (SEQ,) and input_ids.dtype == labels.dtype == torch.long
        assert input_ids.tolist() == stream[i * SEQ:(i + 1) * SEQ], f"window {i}"
        assert torch.equal(labels, input_ids)  # every position carries loss
        assert (labels != IGNORE_INDEX).all()
    with pytest.raises(IndexError):
        dataset[len(dataset)]  # the tail shorter than a window is dropped
    assert len(stream) - len(dataset) * SEQ < SEQ


def test_windows_are_the_same_on_a_second_construction(pretrain_data, tokenizer):
    first, second = (PackedPretrainDataset(pretrain_data, tokenizer, SEQ) for _ in range(2))
    assert len(first) == len(second)
    for i in (0, 1, len(first) // 2, len(first) - 1, 3, 0):  # any order, repeated: rebuilt from the file alone
        assert torch.equal(first[i][0], second[i][0])


def _packed_starts_on_rank(rank: int, world_size: int, port: int, path: str, result_dir: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        dataset = PackedPretrainDataset(path, load_tokenizer(), 48)
        torch.save(torch.from_numpy(dataset.starts), Path(result_dir) / f"starts_{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ranks_share_the_tokenizing_pass_and_get_the_single_process_windows(tmp_path, pretrain_data, tokenizer):
    """Each of 3 gloo ranks tokenizes a third of the records; the all-reduced lengths must be the whole file's."""
    torch.multiprocessing.start_processes(_packed_starts_on_rank, args=(3, free_port(), str(pretrain_data), str(tmp_path)),
                                          nprocs=3, start_method="spawn")
    expected = PackedPretrainDataset(pretrain_data, tokenizer, 48).starts
    for rank in range(3):
        assert torch.equal(torch.load(tmp_path / f"starts_{rank}.pt"), torch.from_numpy(expected)), rank


def test_each_document_starts_with_bos_after_the_previous_ones_eos(tmp_path, tokenizer):
    texts = ["The capital of Peru is Lima.", "", "Cats sleep a lot.", "one two three four five six seven " * 4, "ok"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    seq = 8
    dataset = PackedPretrainDataset(path, tokenizer, seq)
    joined = torch.cat([dataset[i][0] for i in range(len(dataset))]).tolist()
    encoder = text_only_copy(tokenizer)
    position = 0
    for text in texts:  # document by document, as far as the windows reach
        document = [BOS_ID] + encoder.encode(text).ids + [EOS_ID]
        assert joined[position:position + len(document)] == document[:len(joined) - position]
        position += len(document)
    lengths = [len(encoder.encode(text).ids) + 2 for text in texts]
    assert dataset.starts.tolist() == [sum(lengths[:k]) for k in range(len(texts) + 1)]
    assert len(dataset) == sum(lengths) // seq and lengths[1] == 2
    assert joined.count(BOS_ID) == sum(s < len(joined) for s in dataset.starts[:-1])
    assert joined[dataset.starts[1]] == BOS_ID and joined[dataset.starts[1] - 1] == EOS_ID
    # The empty text is [BOS][EOS]: still a document in the stream.
    assert joined[dataset.starts[1]:dataset.starts[2]] == [BOS_ID, EOS_ID]


def test_a_file_too_short_for_one_window_is_a_one_line_error(tmp_path, tokenizer):
    path = tmp_path / "short.jsonl"
    path.write_text(json.dumps({"text": "Too short."}) + "\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=r"short\.jsonl: --pack 1 needs at least --max_seq_len 48 tokens"):
        PackedPretrainDataset(path, tokenizer, SEQ)
    result = train("train_pretrain.py", None, run_args(tmp_path, path, "--pack", "1", "--max_steps", "1"), tmp_path,
                   check=False)
    assert result.returncode == 2, result.stderr
    assert "--pack 1 needs at least --max_seq_len 48 tokens" in result.stderr
    assert "Traceback" not in result.stderr


def test_packed_resume_on_same_world_size_is_bit_identical(tmp_path, pretrain_data):
    common = ["--pack", "1", "--batch_size", "2", "--accumulation_steps", "2", "--epochs", "1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    # The straight run and the split run's first part are independent: side by side.
    first_part = start(2, run_args(split, pretrain_data, *common, "--max_steps", "2"), tmp_path)
    train("train_pretrain.py", 2, run_args(straight, pretrain_data, *common, "--max_steps", "5"), tmp_path)
    assert_exit_code(finish(first_part))
    train("train_pretrain.py", 2, run_args(split, pretrain_data, *common, "--max_steps", "3", "--from_resume", "1"),
          tmp_path)

    assert events_of(split) == [("resume", 2)]
    assert history_file(split, 2)["samples_consumed"] == 16  # 2 steps x 8 windows
    assert resume_file(split)["train_args"]["pack"] == 1
    assert_states_equal(resume_file(straight), resume_file(split))
    key = lambda r: (r["step"], r["rank"])  # noqa: E731
    a, b = sorted(trace_of(straight), key=key), sorted(trace_of(split), key=key)
    assert [(key(r), r["samples"], r["loss"]) for r in a] == [(key(r), r["samples"], r["loss"]) for r in b]
    # Every position carries loss: 2 micro-batches of 2 windows of SEQ tokens per rank and step.
    assert {r["local_tokens"] for r in a} == {2 * 2 * (SEQ - 1)}


def test_resume_refuses_another_pack_or_max_seq_len_naming_it(tmp_path, pretrain_data):
    args = run_args(tmp_path, pretrain_data, "--pack", "1", "--batch_size", "2", "--max_steps", "1")
    train("train_pretrain.py", None, args, tmp_path)
    for flag, value, field in (("--pack", "0", "args.pack: checkpoint has 1, this run has 0"),
                               ("--max_seq_len", "40", "args.max_seq_len: checkpoint has 48, this run has 40")):
        result = train("train_pretrain.py", None, [*args, flag, value, "--from_resume", "1"], tmp_path, check=False)
        assert result.returncode == 2 and "cannot resume" in result.stderr and field in result.stderr, result.stderr
    assert resume_file(tmp_path)["global_step"] == 1  # nothing trained after the refusals


def test_a_checkpoint_from_before_pack_resumes_unpacked_only():
    saved_args = {"batch_size": 4, "accumulation_steps": 1, "global_batch_size": None, "world_size": 1,
                  "epochs": 1, "seed": 42, "max_seq_len": 48}  # written before --pack existed: no "pack"
    saved = {"lm_config": {"hidden_size": 32}, "data_fingerprint": {"sha256": "x"}, "train_args": saved_args}
    unpacked = {**saved_args, "pack": 0}
    assert check_resume_compatible(saved, {"hidden_size": 32}, {"sha256": "x"}, unpacked) == []
    with pytest.raises(ResumeMismatch, match=r"args\.pack: checkpoint has 0, this run has 1"):
        check_resume_compatible(saved, {"hidden_size": 32}, {"sha256": "x"}, {**saved_args, "pack": 1})


def test_sft_has_no_pack_flag_and_records_pack_0():
    class SFTArgs:  # the flags resume_settings reads, as train_full_sft.py's parser has them: no --pack
        batch_size, global_batch_size, epochs, seed, max_seq_len = 4, None, 1, 42, 48
        learning_rate, warmup_ratio, grad_clip, system_prompt_ratio, drop_empty_think_ratio = 1e-5, 0.0, 1.0, 0.0, 0.0
    assert resume_settings(SFTArgs(), 1, 1)["pack"] == 0


def test_packing_stats_prints_the_loss_share_of_both_formats(tmp_path, pretrain_data):
    command = [sys.executable, str(REPO / "benchmarks" / "packing_stats.py"), "--data_path", str(pretrain_data),
               "--max_seq_len", str(SEQ), "--hidden_size", "32", "--num_hidden_layers", "1", "--batch_size", "2",
               "--steps", "1"]
    result = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = {line.split("|")[1].strip(): line for line in result.stdout.splitlines() if "(--pack" in line}
    assert set(rows) == {"padded (--pack 0)", "packed (--pack 1)"}
    assert rows["packed (--pack 1)"].split("|")[3].strip() == "100.0%"  # every position carries loss


def test_shakespeare_speeches_are_speaker_and_lines_without_stage_directions():
    from benchmarks.shakespeare_jsonl import speeches
    markdown = ("# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_FRANCISCO at his post._\n\n"
                "**BERNARDO**  \nWho's there?\n\n**FRANCISCO**  \nNay, answer me:  \nstand.\n\n"
                "_Exit_\n\n### SCENE II. A room.\n\n**HAMLET**  \nA little more than kin.\n")
    assert speeches(markdown) == [(1, "Bernardo: Who's there?"), (1, "Francisco: Nay, answer me:\nstand."),
                                  (2, "Hamlet: A little more than kin.")]
