"""The JSONL index: built in blocks, exact on awkward files, and built once per job (rank 0) and shared.

The distributed tests start two real gloo processes (plain subprocesses that meet through
MASTER_ADDR/MASTER_PORT, with no launcher that could end a waiting rank for them), so a rank
that hangs shows up as a timeout and a rank that fails shows its own error.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dataset.jsonl_file as jsonl_file
from dataset.jsonl_file import DataFileError, JsonlFile
from dataset.lm_dataset import JsonlFile as JsonlFileFromDatasets

from conftest import REPO

RANK_SCRIPT = textwrap.dedent('''
    """One rank: index the file given on the command line with JsonlFile.shared and report."""
    import json, sys
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from dataset.jsonl_file import JsonlFile
    from dataset.lm_dataset import PretrainDataset
    from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    validate_calls = 0

    def validate(record):
        global validate_calls
        validate_calls += 1
        if not isinstance(record.get("text"), str):
            raise ValueError('expected a string field "text"')

    data_path, report_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    try:
        source = JsonlFile.shared(data_path, validate)
    except Exception as error:
        with open(report_path, "w") as f:
            json.dump({"validate_calls": validate_calls, "error_type": type(error).__name__,
                       "error": str(error)}, f)
        raise
    # Two forked DataLoader workers read every record through the shared index.
    loader = DataLoader(range(len(source)), batch_size=2, num_workers=2, multiprocessing_context="fork",
                        collate_fn=lambda indices: [source.read(i) for i in indices])
    records = [record for batch in loader for record in batch]
    pretrain = PretrainDataset(data_path, load_tokenizer(DEFAULT_TOKENIZER), max_seq_len=16)
    with open(report_path, "w") as f:
        json.dump({"validate_calls": validate_calls, "offsets": source.offsets.tolist(),
                   "line_numbers": source.line_numbers.tolist(), "offsets_dtype": str(source.offsets.dtype),
                   "file_size": source.file_size, "records": records,
                   "pretrain_items": [pretrain[i][0].tolist() for i in range(len(pretrain))]}, f)
    dist.destroy_process_group()
''')


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(tmp_path: Path, data_paths: list[Path], timeout: int = 120) -> list[tuple[int, str, dict]]:
    """Run RANK_SCRIPT as ranks 0 and 1 (rank r reads data_paths[r]); return (exit code, stderr, report)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    processes = []
    for rank, data_path in enumerate(data_paths):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        report = tmp_path / f"rank{rank}.json"
        processes.append((subprocess.Popen([sys.executable, str(script), str(data_path), str(report)], env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), report))
    results = []
    try:
        for process, report in processes:
            _, stderr = process.communicate(timeout=timeout)  # a rank left waiting ends the test here
            results.append((process.returncode, stderr, json.loads(report.read_text())))
    finally:
        for process, _ in processes:
            if process.poll() is None:
                process.kill()
    return results


def write_lines(path: Path, lines: list[str], newline: str = "\n", bom: bool = False) -> Path:
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + newline.join(lines).encode("utf-8"))
    return path


def reference_index(path: Path) -> tuple[list[int], list[int], list[dict]]:
    """Offsets, line numbers and records of the non-blank lines, the slow obvious way."""
    offsets, numbers, records = [], [], []
    data = path.read_bytes()
    offset = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    for number, line in enumerate(data[offset:].split(b"\n"), start=1):
        if line.strip():
            offsets.append(offset)
            numbers.append(number)
            records.append(json.loads(line))
        offset += len(line) + 1
    return offsets, numbers, records


AWKWARD_LINES = [
    json.dumps({"text": "第一行：你好，世界。"}, ensure_ascii=False),
    "",
    "   \t",
    json.dumps({"text": "x" * 300}),  # longer than the test's block size
    "  " + json.dumps({"text": "leading spaces and a \u2028 line separator inside"}, ensure_ascii=False),
    json.dumps({"text": "escaped \\n newline"}),
    "\r",
    json.dumps({"text": "最后一行，没有换行符"}, ensure_ascii=False),
]


# One process: the block reader is exact


@pytest.mark.parametrize("block_bytes", [7, 64, 4 * 2**20])
@pytest.mark.parametrize("newline, bom", [("\n", False), ("\r\n", False), ("\n", True)])
def test_index_equals_the_line_by_line_reference_at_any_block_size(tmp_path, monkeypatch, block_bytes, newline, bom):
    monkeypatch.setattr(jsonl_file, "BLOCK_BYTES", block_bytes)  # lines cross block boundaries
    path = write_lines(tmp_path / "awkward.jsonl", AWKWARD_LINES, newline, bom)
    source = JsonlFile(path)
    offsets, numbers, records = reference_index(path)
    assert source.offsets.tolist() == offsets
    assert source.line_numbers.tolist() == numbers == [1, 4, 5, 6, 8]
    assert [source.read(i) for i in range(len(source))] == records


def test_index_is_two_int64_arrays_of_one_entry_per_record(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", [json.dumps({"text": str(i)}) for i in range(1000)])
    source = JsonlFile(path)
    assert source.offsets.dtype == source.line_numbers.dtype == np.int64
    assert source.offsets.nbytes + source.line_numbers.nbytes == 16 * 1000
    assert JsonlFileFromDatasets is JsonlFile  # the old import path keeps working


@pytest.mark.parametrize("block_bytes", [16, 4 * 2**20])
def test_invalid_utf8_names_its_line_even_inside_a_large_block(tmp_path, monkeypatch, block_bytes):
    monkeypatch.setattr(jsonl_file, "BLOCK_BYTES", block_bytes)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n{"text": "ok"}\n')
    with pytest.raises(DataFileError, match=rf"{path}, line 3: the line is not valid UTF-8 text .* at byte 14 of"):
        JsonlFile(path)


def test_validation_error_is_reported_with_file_and_line(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", ['{"text": "a"}', '{"text": 1}'])

    def validate(record):
        if not isinstance(record["text"], str):
            raise ValueError('"text" must be a string')

    with pytest.raises(DataFileError, match=rf'^{path}, line 2: "text" must be a string\. Fix or delete this line'):
        JsonlFile(path, validate)


def test_shared_without_a_process_group_indexes_locally(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", AWKWARD_LINES)
    assert JsonlFile.shared(path).offsets.tolist() == JsonlFile(path).offsets.tolist()


# Two ranks: rank 0 validates, everyone gets the index; rank 0's failure is everyone's


def test_only_rank_0_validates_and_both_ranks_get_the_same_index(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", AWKWARD_LINES, "\r\n")
    (code0, err0, rank0), (code1, err1, rank1) = run_two_ranks(tmp_path, [path, path])
    assert code0 == code1 == 0, err0 + err1
    assert rank0["validate_calls"] == 5 and rank1["validate_calls"] == 0
    offsets, numbers, records = reference_index(path)
    for report in (rank0, rank1):
        assert report["offsets"] == offsets and report["line_numbers"] == numbers
        assert report["offsets_dtype"] == "int64" and report["file_size"] == path.stat().st_size
        assert report["records"] == records  # read through forked DataLoader workers
    assert rank0["pretrain_items"] == rank1["pretrain_items"] and len(rank0["pretrain_items"]) == 5


def test_bad_line_on_rank_0_fails_both_ranks_with_its_file_and_line(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", ['{"text": "fine"}', "", '{"txt": "typo"}', '{"text": "fine"}'])
    (code0, err0, rank0), (code1, err1, rank1) = run_two_ranks(tmp_path, [path, path])
    expected = f'{path}, line 3: expected a string field "text". Fix or delete this line, then start again.'
    assert code0 != 0 and code1 != 0
    assert rank0["error"] == rank1["error"] == expected
    assert rank0["error_type"] == rank1["error_type"] == "DataFileError"  # a ValueError the trainer prints alone
    assert expected in err0 and expected in err1
    assert rank0["validate_calls"] == 2 and rank1["validate_calls"] == 0


def test_missing_file_fails_both_ranks_with_the_same_error(tmp_path):
    path = tmp_path / "missing.jsonl"
    (code0, _, rank0), (code1, _, rank1) = run_two_ranks(tmp_path, [path, path])
    assert code0 != 0 and code1 != 0
    assert rank0["error_type"] == rank1["error_type"] == "FileNotFoundError"
    assert rank0["error"] == rank1["error"] and str(path) in rank0["error"]


def test_ranks_that_see_different_files_fail_together(tmp_path):
    # As on two nodes whose copies of the data differ: offsets from one would not fit the other.
    path0 = write_lines(tmp_path / "node0.jsonl", ['{"text": "one"}', '{"text": "two"}'])
    path1 = write_lines(tmp_path / "node1.jsonl", ['{"text": "one"}'])
    (code0, _, rank0), (code1, _, rank1) = run_two_ranks(tmp_path, [path0, path1])
    assert code0 != 0 and code1 != 0
    assert rank0["validate_calls"] == rank1["validate_calls"] == 0
    sizes = f"rank 1 sees {path1.stat().st_size} bytes, rank 0 sees {path0.stat().st_size} bytes"
    assert sizes in rank0["error"] and sizes in rank1["error"]
    assert "Every rank must read the same file" in rank1["error"]
    assert rank0["error_type"] == rank1["error_type"] == "DataFileError"
