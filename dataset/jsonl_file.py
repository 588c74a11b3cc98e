"""Random access to the records of a JSONL file, validated once and indexed by byte offset.

A pretraining corpus can be gigabytes (minimind's recommended file is 1.2 GB / 1.27 M lines, its
full one 10 GB), so nothing here holds the text: the index is two int64 arrays (where each record
starts, and its line number for error messages), 16 bytes a record, and a record is read and
parsed only when the dataset asks for it.

Building the index reads the file once, in large blocks, and parses every line (`parse_json_text`: JSON
that a tokenizer can read, a lone surrogate escape and nesting past json's reach refused too) so that a
broken line stops the run before training starts, with the file and line number. A FIFO or a folder is
refused before it is opened (a FIFO would wait for a writer). The same
pass hashes every byte (`sha256`, which a resume compares): the blocks are in memory already, and
SHA-256 is about a tenth of the parsing's cost (0.3 s of CPU on top of 2.5-2.8 s for a 400 MB file, measured):

    source = JsonlFile("data.jsonl", validate=check_record)          # one process
    source = JsonlFile.shared("data.jsonl", validate=check_record)   # every rank of a torchrun job

`JsonlFile.shared` lets rank 0 alone read and validate the file and broadcasts the index to the
other ranks, so 8 ranks cost one pass over the data, not 8. If rank 0 finds a bad line, every
rank fails with the same message; none is left waiting.

The index is only true of the file as it was read. Every read checks that it still is: an fstat (the
size and modification time the index saw; about 2 microseconds), and what it reads (the byte before
the record's offset ends a line, and the record is one whole line that fits before the next record's
offset, parses and passes `validate` again: nothing for a text record, about 50 microseconds for a
conversation, some 5% of tokenizing it). A file edited, truncated or replaced under a running trainer
raises DataFileError saying so, rather than a KeyError, or an "invalid JSON" with a wrong line number.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from dataset.json_text import kind_of_file, parse_json_text

# Read this much at a time: thousands of lines, so per-block costs vanish. Larger blocks were
# measured slower (fresh large buffers cost page faults) and only add memory.
BLOCK_BYTES = 4 * 2**20
UTF8_BOM = b"\xef\xbb\xbf"  # some editors start a file with it; it is not part of the first record
BLANK_CHARS = " \t\r\x0b\x0c"  # a line of only these holds no record and is skipped

Validator = Callable[[dict], None]


class DataFileError(ValueError):
    """A bad line in a data file, ranks that see different files, or a file changed under a running
    trainer: the user's to fix.

    The message names the file (and line) and says what to do, so it can be printed alone.
    """

    def __init__(self, message: str = ""):
        # Raised in a DataLoader worker, the error reaches the main process rebuilt from text: "Caught
        # DataFileError in DataLoader worker process 0.\nOriginal Traceback (most recent call last): ...",
        # ending in the line "dataset.jsonl_file.DataFileError: <message>". Keep the message alone: the
        # worker's traceback would bury the one line that names the file and the fix.
        if message.startswith("Caught DataFileError") and "\nOriginal Traceback" in message:
            message = message.rstrip("\n").rsplit("DataFileError: ", 1)[-1]
        super().__init__(message)


# Errors rank 0 may meet while indexing, re-raised with the same class on the other ranks: a bad
# line, a missing or unreadable file. A class comes before its base classes.
SHARED_ERROR_CLASSES = (DataFileError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError, OSError)


class JsonlFile:
    """Random access to the non-empty lines of a JSONL file, each parsed on demand.

    Construction reads the file once: it records where each non-empty line starts, checks that
    it is a JSON object and, if given, runs ``validate(record)``, which should raise ValueError
    describing the problem; a bad line raises DataFileError naming the file and line. Only two
    int64 arrays are kept, and ``sha256``, the hex SHA-256 of the whole file.
    """

    def __init__(self, path: str | os.PathLike, validate: Validator | None = None):
        self.path, self.validate = str(path), validate
        indexed = os.stat(self.path)
        if not stat.S_ISREG(indexed.st_mode):  # opening a FIFO would wait for a writer, a folder has no lines
            raise DataFileError(f"{self.path} is {kind_of_file(indexed.st_mode)}, not a data file: give the path "
                                f"of a JSONL file")
        self.file_size, self.mtime_ns, self.ctime_ns = indexed.st_size, indexed.st_mtime_ns, indexed.st_ctime_ns
        self._offsets, self._line_numbers, self.sha256 = self._build_index(validate)
        self._handle = None
        self._pid: int | None = None
        change = self._change_since_indexed(os.stat(self.path))
        if change is not None:  # the index may hold lines of two versions
            raise DataFileError(f"{self.path} changed while this run indexed it ({change}). Start again once "
                                f"nothing writes to it any more")

    @classmethod
    def shared(cls, path: str | os.PathLike, validate: Validator | None = None) -> JsonlFile:
        """Index `path` once per job: rank 0 reads and validates it, the other ranks receive the index.

        Without an initialized process group of more than one rank this is ``JsonlFile(path, validate)``.
        Every rank of the group must call it (it is a collective), as the datasets do at start-up.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(path, validate)
        return _load_index_on_rank_0_and_broadcast(cls, str(path), validate)

    @classmethod
    def from_index(cls, path: str | os.PathLike, file_size: int, offsets: np.ndarray,
                   line_numbers: np.ndarray, sha256: str, validate: Validator | None = None) -> JsonlFile:
        """A JsonlFile over an index built elsewhere (by rank 0), without reading the file. `validate`:
        the check its records passed, run again on each read. The file's times are this process's view of
        it now (a copy of the file on another node has its own)."""
        source = cls.__new__(cls)
        source.path, source.file_size, source.sha256, source.validate = str(path), int(file_size), sha256, validate
        now = os.stat(path)
        source.mtime_ns, source.ctime_ns = now.st_mtime_ns, now.st_ctime_ns
        source._offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        source._line_numbers = np.ascontiguousarray(line_numbers, dtype=np.int64)
        source._handle, source._pid = None, None
        return source

    def __len__(self) -> int:
        return len(self._offsets)

    @property
    def offsets(self) -> np.ndarray:
        """Byte offset in the file of each record (read-only view)."""
        view = self._offsets.view()
        view.flags.writeable = False
        return view

    @property
    def line_numbers(self) -> np.ndarray:
        """1-based line number in the file of each record (read-only view)."""
        view = self._line_numbers.view()
        view.flags.writeable = False
        return view

    def line_number(self, i: int) -> int:
        """The 1-based line number in the file of record ``i``."""
        return int(self._line_numbers[i])

    def raw_line(self, i: int) -> bytes:
        """The bytes of record ``i`` as stored, without the trailing newline; DataFileError if the file
        is not the one indexed any more (its size or times changed, or the bytes there are not that line)."""
        # A handle opened by a parent process shares its file position with the
        # children after fork (DataLoader workers), so each process opens its own.
        if self._handle is None or self._pid != os.getpid():
            try:
                self._handle = open(self.path, "rb")
            except OSError as error:  # deleted or moved since it was indexed
                raise self._changed(f"it cannot be opened any more: {error.strerror}") from None
            self._pid = os.getpid()
        change = self._change_since_indexed(os.fstat(self._handle.fileno()))  # also a file replaced, once reopened
        if change is not None:
            raise self._changed(change)
        start = int(self._offsets[i])
        end = int(self._offsets[i + 1]) if i + 1 < len(self._offsets) else self.file_size  # blank lines may lie between
        self._handle.seek(max(start - 1, 0))
        before = self._handle.read(1) if start > 0 else b"\n"
        line = self._handle.readline()
        # Where the index put a record: right after a newline (or the BOM of line 1), a whole line that
        # ends before the next record; only the file's last line may lack its newline.
        whole = before == b"\n" or (start == len(UTF8_BOM) and before == UTF8_BOM[-1:])
        whole = whole and start + len(line) <= end and (line.endswith(b"\n") or start + len(line) == self.file_size)
        if not whole or not line.strip():
            raise self._changed_in_place(i, "is not where the index put it")
        return line.rstrip(b"\r\n")

    def read(self, i: int) -> dict[str, Any]:
        """Parse record ``i`` (and check it as the index did)."""
        line_number = self.line_number(i)
        line = self.raw_line(i)
        try:
            record = self._parse(self._decode(line, line_number), line_number)
        except DataFileError:  # every line parsed when the file was indexed
            raise self._changed_in_place(i, "no longer parses as a JSON object") from None
        if self.validate is not None:
            try:
                self.validate(record)
            except ValueError as error:
                raise self._changed_in_place(i, f"no longer passes the check it passed when indexed ({error})") \
                    from None
        return record

    def __getstate__(self) -> dict[str, Any]:
        # Open files cannot be pickled (DataLoader workers under spawn); reopen lazily.
        state = self.__dict__.copy()
        state["_handle"], state["_pid"] = None, None
        return state

    # ---- building the index ---------------------------------------------------------------

    def _build_index(self, validate: Validator | None) -> tuple[np.ndarray, np.ndarray, str]:
        """Read the file block by block; return the offsets and line numbers of its records, and its SHA-256."""
        offsets, line_numbers = [], []
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            start = len(UTF8_BOM) if f.read(len(UTF8_BOM)) == UTF8_BOM else 0
            f.seek(start)
            digest.update(UTF8_BOM[:start])  # the hash is of the file's bytes, a BOM included
            lines_before = 0
            pending = b""  # the start of a line that the previous block cut in two
            while True:
                chunk = f.read(BLOCK_BYTES)
                digest.update(chunk)
                data = pending + chunk if pending else chunk
                # Index whole lines only; at the end of the file the last line needs no newline.
                end = data.rfind(b"\n") + 1 if chunk else len(data)
                block, pending = data[:end], data[end:]
                if block:
                    block_offsets, block_numbers, n_lines = self._index_block(block, lines_before, validate)
                    offsets.append(block_offsets + start)
                    line_numbers.append(block_numbers)
                    start += len(block)
                    lines_before += n_lines
                if not chunk:
                    break
        if not any(len(block_offsets) for block_offsets in offsets):  # an epoch of 0 samples would never end
            raise DataFileError(f"{self.path}: no records: the file is empty or holds only blank lines. "
                                f"Give it one JSON object per line")
        return np.concatenate(offsets), np.concatenate(line_numbers), digest.hexdigest()

    def _index_block(self, block: bytes, lines_before: int,
                     validate: Validator | None) -> tuple[np.ndarray, np.ndarray, int]:
        """Parse and validate the whole lines in `block`; return their offsets within it, their
        line numbers, and how many lines (blank ones included) the block holds."""
        newlines = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == ord("\n"))
        line_starts = np.concatenate([[0], newlines + 1])
        # Decode once per block; json.loads then parses text. The split lines up with `line_starts`
        # because only "\n" ends a line (str.splitlines would also split on "\u2028" and others).
        lines = self._decode(block, lines_before + 1, line_starts).split("\n")
        if block.endswith(b"\n"):
            lines.pop()  # the empty string after the final newline is not a line
        records = []  # positions in `lines` of the lines that hold a record
        for k, line in enumerate(lines):
            # A record line starts with "{", so the strip only runs on the rare line that starts blank.
            if not line or (line[0] in BLANK_CHARS and not line.strip(BLANK_CHARS)):
                continue
            line_number = lines_before + 1 + k
            record = self._parse(line, line_number)
            if validate is not None:
                try:
                    validate(record)
                except ValueError as e:
                    raise self._error(line_number, str(e)) from None
            records.append(k)
        kept = np.array(records, dtype=np.int64)
        return line_starts[kept], kept + lines_before + 1, len(lines)

    # ---- parsing and errors ---------------------------------------------------------------

    def _decode(self, data: bytes, first_line_number: int, line_starts: np.ndarray | None = None) -> str:
        """UTF-8 text of `data` (lines starting at `line_starts`); a bad byte is reported with its line."""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            starts = line_starts if line_starts is not None else np.zeros(1, dtype=np.int64)
            k = int(np.searchsorted(starts, e.start, side="right")) - 1
            raise self._error(first_line_number + k, f"the line is not valid UTF-8 text ({e.reason} at byte "
                              f"{e.start - int(starts[k]) + 1} of the line)") from None

    def _parse(self, line: str, line_number: int) -> dict[str, Any]:
        try:
            record = parse_json_text(line)
        except ValueError as e:
            raise self._error(line_number, str(e)) from None
        if type(record) is not dict:
            raise self._error(line_number, f"expected a JSON object, got {type(record).__name__}")
        return record

    def _error(self, line_number: int, problem: str) -> DataFileError:
        return DataFileError(f"{self.path}, line {line_number}: {problem}. Fix or delete this line, then start again.")

    # ---- a file changed since it was indexed ----------------------------------------------

    def _change_since_indexed(self, stat: os.stat_result) -> str | None:
        """How `stat` differs from the file the index was built from, or None."""
        if stat.st_size != self.file_size:
            return f"it had {self.file_size} bytes and has {stat.st_size}"
        if stat.st_mtime_ns != self.mtime_ns:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stat.st_mtime))
            return f"it was modified at {when}, keeping its size"
        # The change time: the kernel sets it at every write and at every setting of the modification time, and
        # no user can set it back, so an edit in place whose time was put back (`touch -r`, os.utime) shows here.
        # (A chmod or chown sets it too: the file is then read afresh by a resume, which compares its hash.)
        if stat.st_ctime_ns != self.ctime_ns:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stat.st_ctime))
            return f"its inode changed at {when}, keeping its size and modification time: an edit whose time was " \
                   f"put back, or a change of owner or mode"
        return None

    def _changed_in_place(self, i: int, problem: str) -> DataFileError:
        """Record `i` does not read as indexed: say how the file changed (a stat confirms it)."""
        try:
            change = self._change_since_indexed(os.stat(self.path)) or "its size and times are as they were"
        except OSError as error:
            change = f"it cannot be read any more: {error.strerror}"
        return self._changed(f"line {self.line_number(i)} {problem}; {change}")

    def _changed(self, change: str) -> DataFileError:
        return DataFileError(f"{self.path} changed since this run indexed it ({change}). Restore the file, or "
                             f"start again: a new run, or --from_resume 1, indexes it afresh, and a resume compares "
                             f"it with the fingerprint of the data its checkpoint was trained on")


# ---- sharing the index between ranks --------------------------------------------------------

def _load_index_on_rank_0_and_broadcast(cls: type[JsonlFile], path: str, validate: Validator | None) -> JsonlFile:
    """Rank 0 builds the index; a status goes out first, so a failure there fails every rank."""
    device = collective_device()
    _check_every_rank_sees_the_same_file(path, device)
    is_rank_0 = dist.get_rank() == 0
    source, failure = None, None
    if is_rank_0:
        try:
            source = cls(path, validate)
        except Exception as error:  # re-raised below, after the other ranks are told
            failure = error
    status, message = _describe_failure(failure)
    header = torch.tensor([status, len(source) if source is not None else 0,
                           source.file_size if source is not None else 0, len(message)],
                          dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    status, count, file_size, message_length = header.tolist()
    if status != 0:
        text = _tensor_from_bytes(message, device) if is_rank_0 else \
            torch.empty(message_length, dtype=torch.uint8, device=device)
        dist.broadcast(text, src=0)
        if failure is not None:
            raise failure
        raise _rebuild_failure(status, bytes(text.cpu().tolist()).decode("utf-8"))

    if is_rank_0:
        offsets = torch.from_numpy(source.offsets.copy()).to(device)
        line_numbers = torch.from_numpy(source.line_numbers.copy()).to(device)
        digest = _tensor_from_bytes(bytes.fromhex(source.sha256), device)
    else:
        offsets = torch.empty(count, dtype=torch.int64, device=device)
        line_numbers = torch.empty(count, dtype=torch.int64, device=device)
        digest = torch.empty(32, dtype=torch.uint8, device=device)  # SHA-256: 32 bytes
    for tensor in (offsets, line_numbers, digest):
        dist.broadcast(tensor, src=0)
    if is_rank_0:
        return source
    return cls.from_index(path, file_size, offsets.cpu().numpy(), line_numbers.cpu().numpy(),
                          bytes(digest.cpu().tolist()).hex(), validate)


def _describe_failure(failure: Exception | None) -> tuple[int, bytes]:
    """(0, b"") for success; else a status naming the error class and the message to send."""
    if failure is None:
        return 0, b""
    for status, error_class in enumerate(SHARED_ERROR_CLASSES, start=1):
        if isinstance(failure, error_class):
            return status, str(failure).encode("utf-8")
    # An unexpected error (a bug) keeps its traceback on rank 0; the others say where to look.
    return len(SHARED_ERROR_CLASSES) + 1, f"{type(failure).__name__}: {failure}".encode("utf-8")


def _rebuild_failure(status: int, message: str) -> Exception:
    """The error a rank other than 0 raises for rank 0's `status` and `message`."""
    if status <= len(SHARED_ERROR_CLASSES):
        return SHARED_ERROR_CLASSES[status - 1](message)
    return RuntimeError(f"rank 0 failed while indexing the data file ({message}); its traceback shows where")


def _tensor_from_bytes(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8, device=device)


def collective_device() -> torch.device:
    """nccl moves CUDA tensors only; gloo moves CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def each_record_on_its_rank(count: int, value: Callable[[int], int]) -> np.ndarray:
    """[value(i) for i in range(count)] (int64), each rank computing its share (a contiguous slice): one all-reduce
    (a sum: the other ranks' slots are 0) gives every rank all of them. Every rank calls it (a collective)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    values = np.zeros(count, dtype=np.int64)
    for i in range(rank * count // world_size, (rank + 1) * count // world_size):
        values[i] = value(i)
    if world_size > 1:
        shared = torch.from_numpy(values).to(collective_device())
        dist.all_reduce(shared)
        values = shared.cpu().numpy()
    return values


def _check_every_rank_sees_the_same_file(path: str, device: torch.device) -> None:
    """The index is byte offsets, so it only fits a file of the same size (e.g. a copy on each node).

    Every rank learns every rank's size, so they all raise the same error, or none does.
    """
    size = os.path.getsize(path) if os.path.isfile(path) else -1
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([size], dtype=torch.int64, device=device))
    sizes = [int(s.item()) for s in sizes]
    if sizes[0] == -1 or all(s == sizes[0] for s in sizes):
        return  # the same file everywhere, or a missing file that rank 0 reports when it opens it
    rank, other = next((r, s) for r, s in enumerate(sizes) if s != sizes[0])
    seen = "no such file" if other == -1 else f"{other} bytes"
    raise DataFileError(f"{path}: rank {rank} sees {seen}, rank 0 sees {sizes[0]} bytes. Every rank must read "
                     f"the same file: copy it to the same path on each node, or use a shared filesystem.")
